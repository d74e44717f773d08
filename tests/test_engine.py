"""The whole draft -> verify -> commit loop (`verispec.engine`).

- Joint exactness: with order-2 Markov toy models (tests/toy_models.py) the exact distribution of
  a 3-token continuation is known by enumeration (125 cells); the speculative loop run on a large
  batch of identical prompts must match it (Pearson chi-square, threshold at a false-failure rate
  of 1e-9) for several sampling settings and draft lengths. Negative controls (the bugs of
  REFERENCES.md, injected with monkeypatch) must fail the same test.
- Greedy: speculative output equals plain greedy token for token (float32), which equals a naive
  full-recompute reference; acceptance is ~1 with the target as its own draft, ~0 with another model.
- Cache rollback, determinism, stop tokens and max_new_tokens, stats invariants, streaming, input checks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stats_helpers import (
    assert_distributed_as,
    chi_square,
    is_distributed_as,
    threshold,
)

import verispec.drafters.model as model_drafter_module
import verispec.rejection as rejection_module
import verispec.step as step_module
from verispec.config import SamplingParams
from verispec.drafters.model import ModelDrafter
from verispec.engine import generate, generate_all
from verispec.models.llama import LlamaConfig, LlamaForCausalLM, init_weights
from verispec.sampling import process_logits
from verispec.stats import SpecStats

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


# ---------------------------------------------------------------------------------------------
# Joint exactness over several tokens (Markov toy models, exact enumeration)
# ---------------------------------------------------------------------------------------------

JOINT_PROMPT = [3, 1, 4]
JOINT_TOKENS = 3  # 5**3 = 125 cells
JOINT_N = 100_000  # one batch; ~5 s a case on one CPU thread
NEGATIVE_N = 20_000  # the negative controls fail by far more than this needs

T1 = dict(temperature=1.0)
TOPK = dict(temperature=0.7, top_k=3)
TOPP = dict(temperature=1.3, top_p=0.8)
MINP = dict(min_p=0.2)


def _joint_counts(target, drafter, params: SamplingParams, k: int, n: int, prompt: list[int] = JOINT_PROMPT):
    stats = SpecStats()
    outputs = generate_all(target, [prompt] * n, params, drafter, k=k, stats=stats)
    tokens = np.asarray(outputs)  # every row has exactly JOINT_TOKENS tokens (no stop tokens)
    assert tokens.shape == (n, JOINT_TOKENS)
    cells = np.ravel_multi_index(tokens.T, (target.vocab_size,) * JOINT_TOKENS)
    return np.bincount(cells, minlength=target.vocab_size**JOINT_TOKENS), stats


def assert_joint_exact(target, drafter, params: SamplingParams, k: int, n: int, prompt: list[int], label: str):
    """The joint distribution of JOINT_TOKENS tokens after `prompt` is the processed target's (chi-square at
    1e-9), and the rule both accepted and rejected; returns the run's SpecStats."""
    exact = target.continuation_probs(prompt, JOINT_TOKENS, params)  # under the PROCESSED target
    counts, stats = _joint_counts(target, drafter, params, k, n, prompt)
    assert_distributed_as(counts, exact.ravel(), are_counts=True, label=label)
    assert 0 < stats.accepted < stats.proposed, stats.summary()
    return stats


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize(
    "setting, draft",
    [
        pytest.param(T1, "close", id="T1"),
        pytest.param(T1, "random", id="T1-random-draft"),
        pytest.param(TOPK, "close", id="T0.7-topk3"),
        pytest.param(TOPP, "close", id="T1.3-topp0.8"),
        pytest.param(MINP, "close", id="minp0.2"),
    ],
)
def test_joint_distribution_of_three_tokens_is_exact(markov, setting, k, draft):
    target, drafts = markov
    params = SamplingParams(**setting, seed=1000 + k, max_new_tokens=JOINT_TOKENS)
    exact = target.continuation_probs(JOINT_PROMPT, JOINT_TOKENS, params)  # under the PROCESSED target
    counts, stats = _joint_counts(target, ModelDrafter(drafts[draft]), params, k, JOINT_N)
    assert_distributed_as(counts, exact.ravel(), are_counts=True, label=f"{setting} k={k} draft={draft}")
    # every path of the rule was exercised: acceptances, rejections, and (k > 1) whole blocks accepted
    assert 0 < stats.accepted < stats.proposed
    assert stats.accepted_by_position[k - 1] > 0


class DeclaresUniform:
    """Wrong (a negative control): a deterministic drafter's proposals (q one-hot) declared drawn from a uniform q."""

    def __init__(self, drafter, vocab_size: int):
        self.drafter, self.vocab_size = drafter, vocab_size

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, k, sampling):
        draft_token_ids, _ = self.drafter.propose(k, sampling)
        return draft_token_ids, torch.full((*draft_token_ids.shape, self.vocab_size), 1.0 / self.vocab_size)

    def commit(self, num_accepted, next_token_ids, active):
        self.drafter.commit(num_accepted, next_token_ids, active)


def _assert_joint_fails(counts, exact):
    """A negative control: the chi-square test must reject, by a wide margin (not a near miss)."""
    statistic, df = chi_square(counts, exact.ravel())
    assert not is_distributed_as(counts, exact.ravel(), are_counts=True)
    assert statistic > 3 * threshold(df), (statistic, threshold(df))


class _Settings:
    """A batch's RowSampling seen through a wrong `process` (negative controls): everything else is the real one's."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)


class _DeclaresRawQ(_Settings):
    """process returns softmax of the raw logits (declared) while draw draws from the processed q."""

    drawn_from: list[torch.Tensor]

    def process(self, logits):
        self.drawn_from = [self.real.process(logits)]  # what the token is really drawn from
        return process_logits(logits, SamplingParams())  # what is declared: softmax of the raw logits

    def draw(self, probs, positions, modes=("invariant", "rejection")):
        return self.real.draw(self.drawn_from.pop(), positions, modes)


class _DefaultSettings(_Settings):
    def process(self, logits):
        return process_logits(logits, SamplingParams())


def test_negative_control_draft_declares_raw_q(markov, monkeypatch):
    """transformers #47932: q declared from raw logits while the token is drawn from top-k-processed ones."""
    target, drafts = markov
    propose = model_drafter_module.ModelDrafter.propose
    monkeypatch.setattr(
        model_drafter_module.ModelDrafter,
        "propose",
        lambda self, k, sampling: propose(self, k, _DeclaresRawQ(sampling)),
    )
    params = SamplingParams(**TOPK, seed=5, max_new_tokens=JOINT_TOKENS)
    counts, _ = _joint_counts(target, ModelDrafter(drafts["close"]), params, 4, NEGATIVE_N)
    _assert_joint_fails(counts, target.continuation_probs(JOINT_PROMPT, JOINT_TOKENS, params))


def test_negative_control_target_left_at_default_settings(markov, monkeypatch):
    """vLLM #9834: the target's p computed with default settings while the draft used the request's."""
    target, drafts = markov
    rule = step_module.verify_batch
    monkeypatch.setattr(
        step_module,
        "verify_batch",
        lambda scores, ids, probs, sampling, starts: rule(scores, ids, probs, _DefaultSettings(sampling), starts),
    )
    params = SamplingParams(**TOPK, seed=6, max_new_tokens=JOINT_TOKENS)
    counts, _ = _joint_counts(target, ModelDrafter(drafts["close"]), params, 4, NEGATIVE_N)
    _assert_joint_fails(counts, target.continuation_probs(JOINT_PROMPT, JOINT_TOKENS, params))


def test_negative_control_rejection_resamples_from_p(markov, monkeypatch):
    """At a rejection, drawing from p instead of normalize(max(p - q, 0)) biases every position."""
    target, drafts = markov
    monkeypatch.setattr(rejection_module, "_residual_probs", lambda draft_probs, target_probs: target_probs)
    params = SamplingParams(**T1, seed=7, max_new_tokens=JOINT_TOKENS)
    counts, _ = _joint_counts(target, ModelDrafter(drafts["random"]), params, 2, NEGATIVE_N)
    _assert_joint_fails(counts, target.continuation_probs(JOINT_PROMPT, JOINT_TOKENS, params))


def test_toy_model_cache_contract(markov):
    """The toy honours the cache contract, and a missed rollback changes its output."""
    target, _ = markov
    prefixes, junk, continuation = [[1, 2, 3], [4]], torch.tensor([[3, 3], [2, 1]]), torch.tensor([[0, 4], [1, 1]])
    cache = target.new_cache(2, 16)
    target.prefill(prefixes, cache)
    assert cache.host_lengths == [3, 1]
    target(junk, cache)
    assert cache.host_lengths == [5, 3] and cache.lengths.tolist() == [5, 3]
    stale = target(continuation, cache)  # no rollback: the junk is history
    cache.rollback([3, 1])
    logits = target(continuation, cache)
    fresh = target.new_cache(2, 16)
    target.prefill([p + c for p, c in zip(prefixes, continuation.tolist())], fresh)
    assert cache.valid(0) == fresh.valid(0) == [1, 2, 3, 0, 4] and cache.valid(1) == fresh.valid(1) == [4, 1, 1]
    for b, prefix in enumerate(prefixes):
        history = list(prefix)
        for t in range(2):  # position t scores the token after continuation[b, t]
            history.append(int(continuation[b, t]))
            torch.testing.assert_close(logits[b, t], target.next_logits(history), atol=0, rtol=0)
    assert not torch.equal(stale[:, 0], logits[:, 0])


def test_markov_self_draft_accepts_everything_unless_the_draft_cache_forgets(markov):
    """With p == q every proposal is accepted; forgetting x_k after a full block (vLLM PR #9730)
    conditions the order-2 draft on the wrong history and acceptance drops."""
    target, _ = markov
    prompts = [[1 + b % 4, b % 5] for b in range(32)]
    params = SamplingParams(temperature=1.0, seed=4, max_new_tokens=20)
    good, bad = SpecStats(), SpecStats()
    generate_all(target, prompts, params, ModelDrafter(target), k=4, stats=good)
    generate_all(target, prompts, params, ForgetfulDrafter(target), k=4, stats=bad)
    assert good.alpha_hat >= 0.98, good.summary()
    assert bad.alpha_hat < 0.9, bad.summary()


# ---------------------------------------------------------------------------------------------
# Tiny Llama models (float32) for greedy, rollback, stops
# ---------------------------------------------------------------------------------------------

LLAMA = LlamaConfig(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,  # GQA
)
PROMPTS_1 = [[5, 17, 33, 2, 71]]
PROMPTS_4 = [[1, 2, 3, 4, 5, 6, 7], [9], [10, 11, 12], [20, 21, 22, 23, 24]]  # ragged
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)


def tiny_llama(seed: int, noise: float = 0.0) -> LlamaForCausalLM:
    """std 0.3 weights: peaked logits, so float32 greedy has no near-ties to flip."""
    model = init_weights(LlamaForCausalLM(LLAMA), std=0.3, seed=seed).eval()
    if noise:
        generator = torch.Generator().manual_seed(seed + 1000)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(noise * param.std() * torch.randn(param.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def llama():
    return {
        "target": tiny_llama(0),
        "other": tiny_llama(1),  # unrelated: acceptance ~0
        "close": tiny_llama(0, noise=0.03),  # the target, perturbed: acceptance ~0.5
    }


class ForgetfulDrafter(ModelDrafter):
    """vLLM PR #9730: after all k proposals are accepted, x_k is never fed to the draft model."""

    def commit(self, num_accepted, next_token_ids, active):
        super().commit(num_accepted, next_token_ids, active)
        two = torch.tensor([c == 2 for c in self.pending_count])
        self.pending[:, 0] = torch.where(two, self.pending[:, 1], self.pending[:, 0])
        self.pending_count = [1] * len(self.pending_count)


class ScriptedDrafter:
    """A deterministic drafter (draft_probs None) that proposes the next k tokens of a script per row."""

    def __init__(self, scripts: list[list[int]]):
        self.scripts = scripts

    def start(self, prompts, max_length):
        self.position = [0] * len(prompts)

    def propose(self, k, sampling):
        rows = [(script[i : i + k] + [0] * k)[:k] for script, i in zip(self.scripts, self.position)]
        return torch.tensor(rows, dtype=torch.long).reshape(len(rows), k), None

    def commit(self, num_accepted, next_token_ids, active):
        self.position = [i + n + 1 if live else i for i, n, live in zip(self.position, num_accepted, active)]


def naive_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Recompute the whole sequence with a fresh cache at every step; argmax of the last position."""
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            cache = model.new_cache(1, len(sequence))
            logits = model(torch.tensor([sequence]), cache)
            sequence.append(int(logits[0, -1].argmax()))
    return sequence[len(prompt) :]


@pytest.mark.parametrize("prompts", [PROMPTS_1, PROMPTS_4], ids=["batch1", "batch4"])
def test_plain_greedy_equals_naive_full_recompute(llama, prompts):
    plain = generate_all(llama["target"], prompts, GREEDY, drafter=None)
    assert plain == [naive_greedy(llama["target"], p, GREEDY.max_new_tokens) for p in prompts]
    # k = 0 with a drafter is plain decoding through the same code
    assert generate_all(llama["target"], prompts, GREEDY, ModelDrafter(llama["other"]), k=0) == plain


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("prompts", [PROMPTS_1, PROMPTS_4], ids=["batch1", "batch4"])
def test_speculative_greedy_equals_plain_greedy(llama, prompts, k):
    target = llama["target"]
    plain = generate_all(target, prompts, GREEDY, drafter=None)

    self_stats = SpecStats()
    assert generate_all(target, prompts, GREEDY, ModelDrafter(target), k=k, stats=self_stats) == plain
    assert self_stats.alpha_hat >= 0.98, self_stats.summary()

    other_stats = SpecStats()
    assert generate_all(target, prompts, GREEDY, ModelDrafter(llama["other"]), k=k, stats=other_stats) == plain
    assert other_stats.alpha_hat < 0.2, other_stats.summary()


def test_negative_control_draft_cache_forgets_last_proposal(llama):
    """Forgetting x_k after a fully accepted block leaves the output exact but lowers acceptance."""
    target = llama["target"]
    plain = generate_all(target, PROMPTS_4, GREEDY, drafter=None)
    good, bad = SpecStats(), SpecStats()
    assert generate_all(target, PROMPTS_4, GREEDY, ModelDrafter(target), k=4, stats=good) == plain
    assert generate_all(target, PROMPTS_4, GREEDY, ForgetfulDrafter(target), k=4, stats=bad) == plain
    assert good.alpha_hat >= 0.98
    assert bad.alpha_hat < 0.9, bad.summary()


# --- cache rollback ---------------------------------------------------------------------------


def test_rollback_equals_fresh_prefill(llama):
    """Prefix + k junk proposals, roll back to the accepted prefix (ragged), continue: the logits and
    the valid keys/values equal those of a fresh pass over prefix + accepted + continuation."""
    model = llama["target"]
    generator = torch.Generator().manual_seed(0)
    prefixes = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    junk = torch.randint(LLAMA.vocab_size, (3, 4), generator=generator)
    accepted = [0, 2, 4]  # proposals kept per row; the rest were rejected
    continuation = torch.randint(LLAMA.vocab_size, (3, 3), generator=generator)
    with torch.no_grad():
        cache = model.new_cache(3, 32)
        model.prefill(prefixes, cache)
        model(junk, cache)
        cache.rollback([len(p) + a for p, a in zip(prefixes, accepted)])
        logits = model(continuation, cache)  # [3, 3, V]

        full = [p + junk[b, : accepted[b]].tolist() + continuation[b].tolist() for b, p in enumerate(prefixes)]
        assert cache.host_lengths == [len(s) for s in full]
        assert cache.lengths.tolist() == [len(s) for s in full]
        fresh = model.new_cache(3, 32)
        model.prefill(full, fresh)
        for b, sequence in enumerate(full):
            n = len(sequence)
            torch.testing.assert_close(cache.keys[:, b, :n], fresh.keys[:, b, :n], atol=1e-5, rtol=0)
            torch.testing.assert_close(cache.values[:, b, :n], fresh.values[:, b, :n], atol=1e-5, rtol=0)
            reference = model(torch.tensor([sequence]), model.new_cache(1, n))  # one fresh pass, batch 1
            torch.testing.assert_close(logits[b], reference[0, -3:], atol=1e-5, rtol=0)


def test_long_run_with_many_rejections_equals_plain(llama):
    params = SamplingParams(temperature=0, max_new_tokens=120)
    plain = generate_all(llama["target"], PROMPTS_4, params, drafter=None)
    stats = SpecStats()
    assert generate_all(llama["target"], PROMPTS_4, params, ModelDrafter(llama["other"]), k=4, stats=stats) == plain
    assert all(len(row) == 120 for row in plain)
    assert all(r.proposed - r.accepted > 100 for r in stats.requests)  # >100 rollbacks per row


def test_row_finishing_mid_block_while_others_continue(llama):
    """Row 0 accepts a whole block that overshoots its budget and finishes; row 1 rejects everything
    and needs many more passes. The finished row must not break the others (its cache stays in the
    batch). Deterministic drafter: draft_probs None."""
    target = llama["target"]
    prompts = [[1, 2, 3], [5, 6, 7]]
    plain = generate_all(target, prompts, SamplingParams(temperature=0, max_new_tokens=20), drafter=None)
    wrong = [(t + 1) % LLAMA.vocab_size for t in plain[1]]
    for max_new in (1, 2, 6):
        params = SamplingParams(temperature=0, max_new_tokens=max_new)
        stats = SpecStats()
        out = generate_all(target, prompts, params, ScriptedDrafter([plain[0], wrong]), k=4, stats=stats)
        assert out == [row[:max_new] for row in plain]
        assert [r.finish_reason for r in stats.requests] == ["length", "length"]
        assert stats.requests[0].target_passes == -(-max_new // 5)  # whole blocks of k + 1 = 5
        assert stats.requests[1].target_passes == max_new  # one token per pass


# --- determinism ------------------------------------------------------------------------------


def test_same_seed_same_tokens_different_seed_different_tokens(markov):
    target, drafts = markov
    prompts = [[1 + b % 4, b % 5] for b in range(64)]

    def run(seed):
        params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=20)
        return generate_all(target, prompts, params, ModelDrafter(drafts["close"]), k=4)

    first = run(7)
    assert run(7) == first
    assert run(8) != first


# --- stops and budgets ------------------------------------------------------------------------


def _blocks(chunks: list[list[list[int]]], row: int) -> list[list[int]]:
    return [chunk[row] for chunk in chunks if chunk[row]]


def test_stop_token_inside_an_accepted_block(llama):
    target, k = llama["target"], 4
    unstopped_chunks = list(generate(target, PROMPTS_4, GREEDY, ModelDrafter(target), k=k))
    unstopped = [sum(_blocks(unstopped_chunks, row), []) for row in range(len(PROMPTS_4))]
    # a token that first appears strictly inside a block (the block goes on after it)
    choice = None
    for row in range(len(PROMPTS_4)):
        start = 0
        for block in _blocks(unstopped_chunks, row):
            for j in range(len(block) - 1):
                if block[j] not in unstopped[row][: start + j]:
                    choice = choice or (row, start + j, block[j])
            start += len(block)
    assert choice is not None, "no token appears mid-block: pick another model seed"
    stop_row, stop_index, stop_token = choice

    params = SamplingParams(temperature=0, max_new_tokens=GREEDY.max_new_tokens, stop_token_ids=(stop_token,))
    stats = SpecStats()
    chunks = list(generate(target, PROMPTS_4, params, ModelDrafter(target), k=k, stats=stats))
    outputs = [sum(_blocks(chunks, row), []) for row in range(len(PROMPTS_4))]
    for row, (full, out) in enumerate(zip(unstopped, outputs)):
        if stop_token in full:
            assert out == full[: full.index(stop_token) + 1]
            assert stats.requests[row].finish_reason == "stop"
        else:
            assert out == full
            assert stats.requests[row].finish_reason == "length"
        assert stats.requests[row].generated_tokens == len(out)
        # nothing after the last non-empty chunk of a finished row
        last = max(i for i, chunk in enumerate(chunks) if chunk[row])
        assert all(chunk[row] == [] for chunk in chunks[last + 1 :])
    assert outputs[stop_row] == unstopped[stop_row][: stop_index + 1]
    assert stats.generated_tokens == sum(map(len, outputs))


@pytest.mark.parametrize("drafter_name", ["target", "close"])
def test_max_new_tokens_is_exact_for_every_row(llama, drafter_name):
    target = llama["target"]
    longest = generate_all(target, PROMPTS_4, SamplingParams(temperature=0, max_new_tokens=12), drafter=None)
    for max_new in (1, 2, 5, 7, 12):
        params = SamplingParams(temperature=0, max_new_tokens=max_new)
        stats = SpecStats()
        out = generate_all(target, PROMPTS_4, params, ModelDrafter(llama[drafter_name]), k=4, stats=stats)
        assert out == [row[:max_new] for row in longest]
        assert [r.generated_tokens for r in stats.requests] == [max_new] * len(PROMPTS_4)
        assert [r.finish_reason for r in stats.requests] == ["length"] * len(PROMPTS_4)
        assert stats.generated_tokens == max_new * len(PROMPTS_4)


# --- stats --------------------------------------------------------------------------------------


def test_stats_invariants(markov):
    target, drafts = markov
    k, batch = 4, 48
    prompts = [[b % 5] * (1 + b % 4) for b in range(batch)]
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=15, stop_token_ids=(2,))
    stats = SpecStats()
    out = generate_all(target, prompts, params, ModelDrafter(drafts["close"]), k=k, stats=stats)

    assert stats.generated_tokens == sum(map(len, out))
    assert 1 <= stats.mean_tokens_per_pass <= k + 1
    assert stats.alpha_hat == stats.accepted / stats.proposed
    assert 0 < stats.accepted < stats.proposed
    assert 0 <= stats.beta <= 1
    assert len(stats.requests) == batch
    reasons = set()
    for row, request in enumerate(stats.requests):
        assert request.generated_tokens == len(out[row])
        assert request.prompt_tokens == len(prompts[row])
        assert request.proposed == k * request.target_passes
        assert 1 <= request.mean_tokens_per_pass <= k + 1
        assert request.accepted == sum(request.accepted_by_position)
        assert all(
            a <= v <= p
            for a, v, p in zip(request.accepted_by_position, request.verified_by_position, request.proposed_by_position)
        )
        if request.finish_reason == "stop":
            assert out[row][-1] in params.stop_token_ids and params.stop_token_ids[0] not in out[row][:-1]
        else:
            assert request.finish_reason == "length" and len(out[row]) == params.max_new_tokens
            assert params.stop_token_ids[0] not in out[row]
        reasons.add(request.finish_reason)
    assert reasons == {"stop", "length"}
    for name in ("prompt_tokens", "generated_tokens", "target_passes", "proposed", "accepted"):
        assert getattr(stats, name) == sum(getattr(r, name) for r in stats.requests), name
    for name in ("proposed_by_position", "verified_by_position", "accepted_by_position"):
        assert getattr(stats, name) == [sum(col) for col in zip(*(getattr(r, name) for r in stats.requests))], name
    assert stats.proposed_by_position == [stats.target_passes] * k


# --- streaming ----------------------------------------------------------------------------------


def test_streaming_chunks_concatenate_to_generate_all(markov):
    target, drafts = markov
    k, batch = 4, 16
    prompts = [[1 + b % 4] * (1 + b % 3) for b in range(batch)]
    params = SamplingParams(temperature=1.0, seed=21, max_new_tokens=12)
    stats = SpecStats()
    chunks = list(generate(target, prompts, params, ModelDrafter(drafts["close"]), k=k, stats=stats))
    assert all(len(chunk) == batch for chunk in chunks)
    assert all(len(tokens) <= k + 1 for chunk in chunks for tokens in chunk)
    streamed = [sum((chunk[row] for chunk in chunks), []) for row in range(batch)]
    assert streamed == generate_all(target, prompts, params, ModelDrafter(drafts["close"]), k=k)
    assert stats.generated_tokens == sum(map(len, streamed))
    # rows advance at different speeds in the same step
    assert any(len({len(tokens) for tokens in chunk if tokens}) > 1 for chunk in chunks)
    for row in range(batch):  # an active row gets >= 1 token per step; a finished row nothing more
        counts = [len(chunk[row]) for chunk in chunks]
        first_empty = counts.index(0) if 0 in counts else len(counts)
        assert all(c == 0 for c in counts[first_empty:])
        assert sum(counts) == params.max_new_tokens


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts, k, message",
    [
        ([], 4, "non-empty"),
        ([[1, 2], []], 4, r"prompts\[1\] is empty"),
        ([[1, 99]], 4, r"prompts\[0\].*99"),
        ([[1, -1]], 4, r"prompts\[0\].*-1"),
        ([[1, 2]], -1, r"\bk\b.*-1"),
    ],
    ids=["no-prompts", "empty-prompt", "id-too-large", "id-negative", "negative-k"],
)
def test_bad_input_raises_value_error(markov, prompts, k, message):
    target, drafts = markov
    params = SamplingParams(max_new_tokens=2, seed=0)
    with pytest.raises(ValueError, match=message):
        generate_all(target, prompts, params, ModelDrafter(drafts["close"]), k=k)
    with pytest.raises(ValueError, match=message):  # the generator raises at its first step
        next(generate(target, prompts, params, ModelDrafter(drafts["close"]), k=k))


def test_a_prompt_and_budget_beyond_the_models_context_is_refused_before_any_work(llama):
    """Past max_position_embeddings a model produces garbage: one ValueError, nothing generated."""
    target = llama["target"]
    context = target.config.max_position_embeddings
    prompt = [1] * (context - 10)
    assert (
        len(generate_all(target, [prompt], SamplingParams(temperature=0, max_new_tokens=10))[0]) == 10
    )  # exactly fits
    calls = []
    drafter = ModelDrafter(llama["close"])
    drafter.start = lambda *args: calls.append(args)
    with pytest.raises(ValueError, match=f"context of {context} positions"):
        generate_all(target, [[1, 2], prompt], SamplingParams(temperature=0, max_new_tokens=11), drafter, k=2)
    assert calls == []
