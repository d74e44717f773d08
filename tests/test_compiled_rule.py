"""The compiled rule (`verispec_rule` in llamacpp/llama_step.c) is the Python rule (`rejection.verify_batch`).

Both run on the same random cases: the target's raw logits [k+1, V], the draft's proposals and
its q, and the same uniform numbers in the same roles (u_i for the test of position i, u_k for
the recovered or bonus draw: `verify`'s). Accepted counts and output tokens must be equal and
beta equal to float tolerance, at T = 0 and T > 0, over thousands of rows with every acceptance
count. The compiled step draws its numbers from the row's splitmix64 stream in turn instead
(the tests of positions 0..n, then the draw): checked against the same rule with those numbers
given. Negative controls: one uniform or one logit changed on the compiled side only is found.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.config import SamplingParams
from verispec.llamacpp import compiled_rule, step_status
from verispec.rejection import verify_batch
from verispec.sampling import RowSampling, process_logits
from verispec.streams import GAMMA, RowStreams

pytestmark = pytest.mark.skipif(not step_status().startswith("compiled step loaded"), reason="no compiled step here")

ROWS = 600
MASK = (1 << 64) - 1


def _case(seed: int, rows: int, k: int, vocab: int, temperature: float):
    """(logits [B, k+1, V], proposals [B, k], q [B, k, V] or None at T = 0): drafts near the target,
    some far, so that every acceptance count 0..k occurs."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, k + 1, vocab, generator=generator) * 3
    noise = torch.rand(rows, 1, 1, generator=generator) * 4  # per row: a draft from close to unrelated
    draft_logits = logits[:, :k] + noise * torch.randn(rows, k, vocab, generator=generator)
    if temperature == 0:
        return logits, draft_logits.argmax(-1), None
    q = process_logits(draft_logits, SamplingParams(temperature=temperature))  # [B, k, V] float32
    proposals = (
        torch.multinomial(q.reshape(-1, vocab), 1, generator=generator).reshape(rows, k)
        if k
        else q.new_zeros(rows, 0).long()
    )
    return logits, proposals, q


def _python(logits, proposals, q, temperature: float, seed: int):
    """verify_batch as the engine runs it, and the uniform numbers it used ([B, k+1] by role)."""
    rows, k = proposals.shape
    sampling = RowSampling(SamplingParams(temperature=temperature, seed=seed), rows)
    uniforms = RowStreams(sampling.seeds).uniform((rows, k + 1)).numpy()  # the numbers verify draws: k tests, one draw
    scores = logits.argmax(-1) if temperature == 0 else logits  # what step.score hands the rule
    output, accepted, beta, _ = verify_batch(scores, proposals, q, sampling, [0] * rows)
    found = [
        (out[: n + 1], n, b[: min(n + 1, k)])
        for out, n, b in zip(output.tolist(), accepted.tolist(), beta.double().tolist())
    ]
    return found, uniforms, sampling


def _compiled(logits, proposals, q, temperature: float, uniforms) -> list:
    return [
        compiled_rule(
            logits[b].numpy(),
            proposals[b].numpy(),
            None if q is None else q[b].numpy(),
            temperature,
            uniforms=None if uniforms is None else uniforms[b],
        )[:3]
        for b in range(len(proposals))
    ]


def _mismatches(compiled: list, python: list) -> list[int]:
    """Rows whose output tokens, accepted count or beta (to 1e-5) differ."""
    return [
        b
        for b, ((out, n, beta), (py_out, py_n, py_beta)) in enumerate(zip(compiled, python))
        if out != py_out or n != py_n or len(beta) != len(py_beta) or not np.allclose(beta, py_beta, atol=1e-5, rtol=0)
    ]


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0, 1.7])
@pytest.mark.parametrize("k, vocab", [(0, 64), (1, 64), (3, 64), (6, 64), (4, 4096)])
def test_the_compiled_rule_equals_the_python_rule(k, vocab, temperature):
    seed = 1000 * k + vocab + int(10 * temperature)
    rows = ROWS if vocab <= 64 else ROWS // 6
    logits, proposals, q = _case(seed, rows, k, vocab, temperature)
    python, uniforms, _ = _python(logits, proposals, q, temperature, seed)
    compiled = _compiled(logits, proposals, q, temperature, None if temperature == 0 else uniforms)
    assert _mismatches(compiled, python) == []
    assert {n for _, n, _ in python} == set(range(k + 1))  # not vacuous: every acceptance count occurs


@pytest.mark.parametrize("k", [1, 3, 6])
def test_the_compiled_step_draws_the_rules_numbers_from_the_rows_stream(k):
    """From a row's stream (the compiled step's way) the rule takes the numbers 1..n+1 for its tests
    and number n+2 (n < k) or k+1 for its draw: the rule given those numbers gives the same row,
    and the stream advances by as many."""
    rows, vocab, temperature = 300, 64, 0.8
    logits, proposals, q = _case(77 + k, rows, k, vocab, temperature)
    sampling = RowSampling(SamplingParams(temperature=temperature, seed=5), rows)
    keys = sampling.streams.keys.numpy().view(np.uint64)
    numbers = RowStreams(sampling.seeds).uniform((rows, k + 2)).numpy()  # each row's first k + 2 numbers
    accepted = set()
    for b in range(rows):
        out, n, beta, state = compiled_rule(
            logits[b].numpy(), proposals[b].numpy(), q[b].numpy(), temperature, rng=int(keys[b])
        )
        used = min(n + 2, k + 1)
        given = np.concatenate([numbers[b, :k], [numbers[b, used - 1]]])
        assert compiled_rule(logits[b].numpy(), proposals[b].numpy(), q[b].numpy(), temperature, uniforms=given)[
            :3
        ] == (out, n, beta)
        assert state == (int(keys[b]) + used * (GAMMA & MASK)) & MASK
        accepted.add(n)
    assert accepted == set(range(k + 1))


def test_negative_control_one_uniform_changed_on_the_compiled_side_is_found():
    k, vocab, temperature = 3, 64, 1.0
    logits, proposals, q = _case(11, ROWS, k, vocab, temperature)
    python, uniforms, _ = _python(logits, proposals, q, temperature, 11)
    p = process_logits(logits, SamplingParams(temperature=temperature))
    ratio = (p[:, 0].gather(-1, proposals[:, :1]) / q[:, 0].gather(-1, proposals[:, :1])).squeeze(-1)  # [B] p/q at x_1
    row = next(b for b, (_, n, _) in enumerate(python) if n >= 1 and ratio[b] < 0.9)  # x_1 accepted, not surely
    planted = uniforms.copy()
    planted[row, 0] = 0.95  # u_1 q(x_1) > p(x_1): a rejection at position 1 on the compiled side only
    assert _mismatches(_compiled(logits, proposals, q, temperature, planted), python) == [row]


def test_negative_control_one_logit_changed_on_the_compiled_side_is_found():
    k, vocab = 3, 64
    logits, proposals, _ = _case(12, ROWS, k, vocab, 0.0)
    python, _, _ = _python(logits, proposals, None, 0.0, 12)
    row = next(b for b, (_, n, _) in enumerate(python) if n >= 1)  # x_1 is the target's argmax
    planted = logits.clone()
    planted[row, 0, proposals[row, 0]] -= 100.0  # x_1 is no longer the argmax: rejected
    assert _mismatches(_compiled(planted, proposals, None, 0.0, None), python) == [row]
