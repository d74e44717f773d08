"""The compiled rule (`verispec_rule` in llamacpp/llama_step.c) is the Python rule (`rejection.verify_batch`).

Both run on the same random cases: the target's raw logits [k+1, V], the draft's processed q,
proposals drawn from q sharpened by a proposal temperature tau (proposal.sharpen; tau 1: q, 0:
its argmax), and the same uniform numbers in the same roles (u_i for the test of position i, u_k
for the recovered or bonus draw: `verify`'s). The compiled rule is given q and tau and sharpens
q itself, as the compiled step does; the Python rule is given sharpen(q, tau). Accepted counts
and output tokens must be equal, beta equal to float tolerance, and the grid of counterfactual
acceptances equal to proposal.acceptance_grid, at T = 0, at T > 0 with and without top-k, top-p
and min-p, over thousands of rows with every acceptance count. The compiled processing of logits
(`verispec_process`) is process_logits, ties at the k-th value included. The compiled step
draws its numbers from the row's splitmix64 stream in turn instead (the tests of positions
0..n, then the draw): checked against the same rule with those numbers given. Negative
controls: one uniform or one logit changed on the compiled side only is found, and so is the
compiled rule told q where the proposals came from q sharpened.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.config import SamplingParams
from verispec.llamacpp import compiled_process, compiled_rule, step_status
from verispec.proposal import TAUS, acceptance_grid, sharpen
from verispec.rejection import verify_batch
from verispec.sampling import RowSampling, process_logits
from verispec.streams import GAMMA, RowStreams

pytestmark = pytest.mark.skipif(not step_status().startswith("compiled step loaded"), reason="no compiled step here")

ROWS = 600
MASK = (1 << 64) - 1
TRUNCATED = {  # name -> settings with filters (V = 64: top-k 20; V = 4096: llama.cpp's defaults)
    "top-k+top-p+min-p": lambda vocab: dict(temperature=1.0, top_k=20 if vocab <= 64 else 40, top_p=0.95, min_p=0.05),
    "min-p": lambda vocab: dict(temperature=0.7, min_p=0.1),
}


def _case(seed: int, rows: int, k: int, vocab: int, params: SamplingParams, tau: float = 1.0, scale: float = 3.0):
    """(logits [B, k+1, V], proposals [B, k], q [B, k, V] or None at T = 0): drafts near the target,
    some far, so that every acceptance count 0..k occurs; proposals drawn from sharpen(q, tau)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, k + 1, vocab, generator=generator) * scale
    noise = torch.rand(rows, 1, 1, generator=generator) * 4  # per row: a draft from close to unrelated
    draft_logits = logits[:, :k] + noise * torch.randn(rows, k, vocab, generator=generator)
    if params.greedy:
        return logits, draft_logits.argmax(-1), None
    q = process_logits(draft_logits, params)  # [B, k, V] float32
    proposal = sharpen(q, tau).reshape(-1, vocab)
    proposals = (
        torch.multinomial(proposal, 1, generator=generator).reshape(rows, k) if k else q.new_zeros(rows, 0).long()
    )
    return logits, proposals, q


def _python(logits, proposals, q, params: SamplingParams, seed: int, tau: float = 1.0):
    """verify_batch as the engine runs it (told sharpen(q, tau)), the uniform numbers it used ([B, k+1] by
    role) and the grid [B, k, G] of proposal.acceptance_grid."""
    rows, k = proposals.shape
    params = SamplingParams(**{**params.__dict__, "seed": seed})
    sampling = RowSampling(params, rows)
    uniforms = RowStreams(sampling.seeds).uniform((rows, k + 1)).numpy()  # the numbers verify draws: k tests, one draw
    scores = logits.argmax(-1) if params.greedy else logits  # what step.score hands the rule
    declared = None if q is None else sharpen(q, tau)
    output, accepted, beta, target_probs = verify_batch(scores, proposals, declared, sampling, [0] * rows)
    grid = acceptance_grid(q, target_probs, TAUS).double() if q is not None and k else None  # [B, k, G]
    found = [
        (out[: n + 1], n, b[: min(n + 1, k)], None if grid is None else grid[row, : min(n + 1, k)].numpy())
        for row, (out, n, b) in enumerate(zip(output.tolist(), accepted.tolist(), beta.double().tolist()))
    ]
    return found, uniforms


def _compiled(logits, proposals, q, params: SamplingParams, uniforms, tau: float = 1.0) -> list:
    found = []
    for b in range(len(proposals)):
        out, n, beta, _, grid = compiled_rule(
            logits[b].numpy(),
            proposals[b].numpy(),
            None if q is None else q[b].numpy(),
            params,
            uniforms=None if uniforms is None else uniforms[b],
            tau=tau,
            grid_taus=TAUS if q is not None else (),
        )
        found.append((out, n, beta, grid if q is not None and proposals.shape[1] else None))
    return found


def _mismatches(compiled: list, python: list) -> list[int]:
    """Rows whose output tokens, accepted count, beta or grid (to 1e-5) differ."""
    return [
        b
        for b, ((out, n, beta, grid), (py_out, py_n, py_beta, py_grid)) in enumerate(zip(compiled, python))
        if out != py_out
        or n != py_n
        or len(beta) != len(py_beta)
        or not np.allclose(beta, py_beta, atol=1e-5, rtol=0)
        or (grid is None) != (py_grid is None)
        or (grid is not None and (grid.shape != py_grid.shape or not np.allclose(grid, py_grid, atol=1e-5, rtol=0)))
    ]


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0, 1.7])
@pytest.mark.parametrize("k, vocab", [(0, 64), (1, 64), (3, 64), (6, 64), (4, 4096)])
def test_the_compiled_rule_equals_the_python_rule(k, vocab, temperature):
    seed = 1000 * k + vocab + int(10 * temperature)
    rows = ROWS if vocab <= 64 else ROWS // 6
    params = SamplingParams(temperature=temperature)
    logits, proposals, q = _case(seed, rows, k, vocab, params)
    python, uniforms = _python(logits, proposals, q, params, seed)
    compiled = _compiled(logits, proposals, q, params, None if temperature == 0 else uniforms)
    assert _mismatches(compiled, python) == []
    assert {n for _, n, _, _ in python} == set(range(k + 1))  # not vacuous: every acceptance count occurs


@pytest.mark.parametrize("tau", [1.0, 0.5, 0.2, 0.0])
@pytest.mark.parametrize("setting", sorted(TRUNCATED))
@pytest.mark.parametrize("k, vocab", [(3, 64), (4, 4096)])
def test_the_compiled_rule_equals_the_python_rule_truncated_and_sharpened(k, vocab, setting, tau):
    seed = 7000 + 100 * k + sorted(TRUNCATED).index(setting) * 10 + int(10 * tau)
    rows = ROWS if vocab <= 64 else ROWS // 6
    params = SamplingParams(**TRUNCATED[setting](vocab))
    logits, proposals, q = _case(seed, rows, k, vocab, params, tau, 3.0 if vocab <= 64 else 6.0)  # peaked: all accepted
    python, uniforms = _python(logits, proposals, q, params, seed, tau)
    assert _mismatches(_compiled(logits, proposals, q, params, uniforms, tau), python) == []
    assert {n for _, n, _, _ in python} == set(range(k + 1))  # not vacuous: every acceptance count occurs
    assert int((q[:, 0] > 0).sum(-1).max()) < vocab  # not vacuous: the filters removed tokens


@pytest.mark.parametrize("setting", [dict(temperature=1.0), *(f(4096) for f in TRUNCATED.values())])
def test_the_compiled_processing_is_process_logits(setting):
    """verispec_process gives process_logits's distribution and support, ties at the k-th value included."""
    generator, params = torch.Generator().manual_seed(3), SamplingParams(**setting)
    for row in range(40):
        logits = torch.randn(4096, generator=generator) * 3
        if row % 4 == 0 and params.top_p == 1.0:  # whole numbers: many ties at the k-th value (top-p's order of
            logits = torch.randint(0, 8, (4096,), generator=generator).float()  # ties is torch's own choice)
        expected = process_logits(logits, params).numpy()
        probs, support = compiled_process(logits.numpy(), params)
        assert [t for t in support if probs[t] > 0] == np.flatnonzero(expected > 0).tolist()
        assert np.allclose(probs, expected, atol=1e-6, rtol=1e-5)


def test_negative_control_the_compiled_processing_with_another_top_k():
    params = SamplingParams(temperature=1.0, top_k=40)
    logits = torch.randn(4096, generator=torch.Generator().manual_seed(4)) * 3
    probs, _ = compiled_process(logits.numpy(), SamplingParams(temperature=1.0, top_k=41))
    assert not np.allclose(probs, process_logits(logits, params).numpy(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_the_compiled_step_draws_the_rules_numbers_from_the_rows_stream(k):
    """From a row's stream (the compiled step's way) the rule takes the numbers 1..n+1 for its tests
    and number n+2 (n < k) or k+1 for its draw: the rule given those numbers gives the same row,
    and the stream advances by as many."""
    rows, vocab, params = 300, 64, SamplingParams(temperature=0.8, top_k=30, min_p=0.02)
    logits, proposals, q = _case(77 + k, rows, k, vocab, params, 0.5)
    sampling = RowSampling(SamplingParams(temperature=0.8, seed=5), rows)
    keys = sampling.streams.keys.numpy().view(np.uint64)
    numbers = RowStreams(sampling.seeds).uniform((rows, k + 2)).numpy()  # each row's first k + 2 numbers
    accepted = set()
    for b in range(rows):
        given = dict(tau=0.5, grid_taus=TAUS)
        out, n, beta, state, grid = compiled_rule(
            logits[b].numpy(), proposals[b].numpy(), q[b].numpy(), params, rng=int(keys[b]), **given
        )
        used = min(n + 2, k + 1)
        numbers_given = np.concatenate([numbers[b, :k], [numbers[b, used - 1]]])
        again = compiled_rule(
            logits[b].numpy(), proposals[b].numpy(), q[b].numpy(), params, uniforms=numbers_given, **given
        )
        assert again[:3] == (out, n, beta) and np.array_equal(again[4], grid)
        assert state == (int(keys[b]) + used * (GAMMA & MASK)) & MASK
        accepted.add(n)
    assert accepted == set(range(k + 1))


def test_negative_control_one_uniform_changed_on_the_compiled_side_is_found():
    k, vocab, params = 3, 64, SamplingParams(temperature=1.0)
    logits, proposals, q = _case(11, ROWS, k, vocab, params)
    python, uniforms = _python(logits, proposals, q, params, 11)
    p = process_logits(logits, params)
    ratio = (p[:, 0].gather(-1, proposals[:, :1]) / q[:, 0].gather(-1, proposals[:, :1])).squeeze(-1)  # [B] p/q at x_1
    row = next(b for b, (_, n, _, _) in enumerate(python) if n >= 1 and ratio[b] < 0.9)  # x_1 accepted, not surely
    planted = uniforms.copy()
    planted[row, 0] = 0.95  # u_1 q(x_1) > p(x_1): a rejection at position 1 on the compiled side only
    assert _mismatches(_compiled(logits, proposals, q, params, planted), python) == [row]


def test_negative_control_one_logit_changed_on_the_compiled_side_is_found():
    k, vocab, params = 3, 64, SamplingParams(temperature=0.0)
    logits, proposals, _ = _case(12, ROWS, k, vocab, params)
    python, _ = _python(logits, proposals, None, params, 12)
    row = next(b for b, (_, n, _, _) in enumerate(python) if n >= 1)  # x_1 is the target's argmax
    planted = logits.clone()
    planted[row, 0, proposals[row, 0]] -= 100.0  # x_1 is no longer the argmax: rejected
    assert _mismatches(_compiled(planted, proposals, None, params, None), python) == [row]


def test_negative_control_the_compiled_rule_told_q_where_the_proposals_came_from_q_sharpened():
    k, vocab, params = 3, 64, SamplingParams(**TRUNCATED["top-k+top-p+min-p"](64))
    logits, proposals, q = _case(13, ROWS, k, vocab, params, 0.5)
    python, uniforms = _python(logits, proposals, q, params, 13, 0.5)
    assert len(_mismatches(_compiled(logits, proposals, q, params, uniforms, 1.0), python)) > ROWS // 10


@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.6), TRUNCATED["top-k+top-p+min-p"](64)])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_the_compiled_rule_for_a_lookup_is_the_python_coupled_form(k, setting):
    """A lookup's proposals (q one-hot, `given` to the compiled step): the compiled rule draws y_i ~ p_i with
    the number of role i and keeps x_i while y_i == x_i, as `verify` with draft_probs None; beta = p(x_i).
    Peaked logits and proposals near the target, so that every acceptance count occurs."""
    seed = 9000 + 10 * k + len(setting)
    params = SamplingParams(**setting)
    logits, proposals, _ = _case(seed, ROWS, k, 64, params, 0.0, 6.0)  # proposals: a close draft's argmax
    python, uniforms = _python(logits, proposals, None, params, seed)
    assert _mismatches(_compiled(logits, proposals, None, params, uniforms), python) == []
    assert {n for _, n, _, _ in python} == set(range(k + 1))  # not vacuous


def test_negative_control_the_rejection_form_where_the_proposals_were_a_lookups():
    """Told a q (the rejection form: u q(x) < p(x)) where the compiled side ran the coupled form, rows differ."""
    k, vocab, params = 3, 64, SamplingParams(temperature=1.0)
    logits, proposals, q = _case(14, ROWS, k, vocab, params, 0.0, 6.0)
    one_hot = torch.nn.functional.one_hot(proposals, vocab).float()  # the lookup's q, declared as a distribution
    python, uniforms = _python(logits, proposals, one_hot, params, 14)  # the same q, the rejection form's numbers
    compiled = _compiled(logits, proposals, None, params, uniforms)
    differ = [b for b, (c, py) in enumerate(zip(compiled, python)) if c[:2] != py[:2]]  # tokens or accepted count
    assert len(differ) > ROWS // 10
