"""Two drafters as one (`verispec.drafters.combined`): the lookup's proposal where it is confident, the model's
elsewhere.

- Exactness through the engine: the joint distribution of a 3-token continuation of the order-2 Markov toy
  under a prompt with repeats, chi-square at a 1e-9 false-failure rate, with passes by lookup alone and mixed
  passes (rows taking the lookup's tokens beside rows taking the model's, q dense); greedy output equals plain
  greedy with a tiny float32 Llama, batch 1 and ragged 4.
- State: after every pass the model's cache and pending tokens are exactly each row's committed tokens.
- Negative control: a mixed pass that declares the model's q for rows that took the lookup's tokens fails.
- The gate (`LookupGate`): a row takes a confident lookup's tokens while the lookup's first tokens have been
  committed at least as often as the model's first proposals were accepted; a lookup that always misses is set
  aside after two misses, one that always hits drafts every pass.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import (
    JOINT_N,
    JOINT_TOKENS,
    PROMPTS_1,
    PROMPTS_4,
    T1,
    _assert_joint_fails,
    assert_joint_exact,
    tiny_llama,
)
from test_engine import _joint_counts as engine_joint_counts

from verispec.config import SamplingParams
from verispec.drafters.combined import CombinedDrafter, LookupGate
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.engine import generate_all
from verispec.stats import SpecStats

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py

REPEAT_PROMPT = [3, 1, 4, 1, 3, 1, 4]  # "3 1 4" and "1 4" recur: the lookup is confident from the first pass


def _combined(draft) -> CombinedDrafter:
    return CombinedDrafter(PromptLookupDrafter(max_ngram=2, min_ngram=2), ModelDrafter(draft))


@pytest.mark.parametrize("k", [2, 4])
def test_joint_distribution_of_three_tokens_is_exact(markov, k):
    target, drafts = markov
    params = SamplingParams(**T1, seed=3000 + k, max_new_tokens=JOINT_TOKENS)
    drafter = _combined(drafts["close"])
    assert_joint_exact(target, drafter, params, k, JOINT_N, REPEAT_PROMPT, f"T1 k={k} ngram+model")
    assert drafter.lookup_passes > 0 and drafter.mixed_passes > 0  # both kinds of pass ran


class _DeclaresModelQ(CombinedDrafter):
    """Wrong: on a mixed pass, rows that took the lookup's tokens keep the model's q."""

    def propose(self, k, sampling):
        proposal, probs = super().propose(k, sampling)
        if probs is not None and self._model_ran:
            probs = self.drafter._declared  # the model's own q, kept by the wrapper below
        return proposal, probs


class _KeepsQ(ModelDrafter):
    def propose(self, k, sampling, counted=None):
        proposal, probs = super().propose(k, sampling, counted)
        self._declared = probs
        return proposal, probs


def test_negative_control_lookup_tokens_declared_with_the_models_q(markov):
    target, drafts = markov
    params = SamplingParams(**T1, seed=7, max_new_tokens=JOINT_TOKENS)
    drafter = _DeclaresModelQ(PromptLookupDrafter(max_ngram=2, min_ngram=2), _KeepsQ(drafts["close"]))
    counts, _ = engine_joint_counts(target, drafter, params, 2, JOINT_N, prompt=REPEAT_PROMPT)  # a subtler bug
    _assert_joint_fails(counts, target.continuation_probs(REPEAT_PROMPT, JOINT_TOKENS, params))


GREEDY_LONG = SamplingParams(temperature=0, max_new_tokens=120)


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("prompts", [PROMPTS_1, PROMPTS_4], ids=["batch1", "batch4"])
def test_speculative_greedy_equals_plain_greedy(prompts, k):
    target, draft = tiny_llama(0), tiny_llama(0, noise=0.02)
    plain = generate_all(target, prompts, GREEDY_LONG, drafter=None)
    stats = SpecStats()
    drafter = CombinedDrafter(PromptLookupDrafter(), ModelDrafter(draft))
    assert generate_all(target, prompts, GREEDY_LONG, drafter, k=k, stats=stats) == plain
    assert drafter.lookup_passes + drafter.mixed_passes > 0 and 0 < stats.accepted < stats.proposed


class _Checked(CombinedDrafter):
    """After every commit: the model's cache holds each running row's committed tokens but the pending ones, and
    its pending tokens are the rest (the lookup's history is the committed sequence: tests/test_ngram.py). A row
    that finished is never read again, and the model does not keep its pending tokens."""

    checks = 0

    def commit(self, num_accepted, next_token_ids, active):
        super().commit(num_accepted, next_token_ids, active)
        model = self.drafter
        for row in (row for row, on in enumerate(active) if on):
            history = self.lookup.history(row)
            count = model.pending_count[row]
            assert model.cache.host_lengths[row] + count == len(history), row
            assert model.pending[row, :count].tolist() == history[len(history) - count :], row
        _Checked.checks += 1


def test_the_models_state_is_the_committed_tokens_after_every_pass(markov):
    target, drafts = markov
    params = SamplingParams(**T1, seed=5, max_new_tokens=30)
    prompts = [REPEAT_PROMPT, [0, 2, 4, 1], REPEAT_PROMPT[:4], [2, 2, 2]]
    drafter = _Checked(PromptLookupDrafter(max_ngram=2, min_ngram=2), ModelDrafter(drafts["close"]))
    generate_all(target, prompts, params, drafter, k=3)
    assert _Checked.checks > 5 and drafter.lookup_passes + drafter.mixed_passes > 0


def test_a_lookup_without_confident_is_refused():
    with pytest.raises(ValueError, match="confident"):
        CombinedDrafter(object(), ModelDrafter(torch.nn.Linear(1, 1)))


def test_the_gate_compares_each_rows_measured_first_token_acceptance():
    gate = LookupGate()
    gate.add_rows(2)
    assert gate.prefers_lookup(0)  # prior: the lookup until it misses
    gate.observe(0, lookup=0.0, model=None)  # a miss: 1/2 against the model's prior 1/2, a tie
    assert gate.prefers_lookup(0)
    gate.observe(0, lookup=0.0, model=None)  # 1/3 < 1/2
    assert not gate.prefers_lookup(0) and gate.prefers_lookup(1)  # each row its own
    gate.observe(0, lookup=None, model=0.0)  # the model's 1/3: a tie again
    assert gate.prefers_lookup(0)
    gate.observe(0, lookup=1.0, model=1.0)  # lookup 2/4, model 2/4
    gate.observe(0, lookup=None, model=1.0)  # model 3/5
    assert not gate.prefers_lookup(0)
    gate.keep_rows([1])
    assert gate.prefers_lookup(0)  # the untouched row


class _Scripted:
    """A lookup for one row that proposes plain greedy decoding's next k tokens, each shifted by `offset` in id
    (0: always right; else its first token always wrong), confident at every pass."""

    can_change_rows = False

    def __init__(self, plain: list[int], offset: int, vocab: int):
        self.plain, self.offset, self.vocab = plain, offset, vocab

    def start(self, prompts, max_length):
        self.at = 0  # tokens committed after the prompt

    def confident(self, k):
        ahead = (self.plain[self.at : self.at + k] + [0] * k)[:k]
        return torch.tensor([[(t + self.offset) % self.vocab for t in ahead]]), [k]

    def take(self, proposal):
        pass

    def commit(self, num_accepted, next_token_ids, active):
        self.at += num_accepted[0] + 1 if active[0] else 0


@pytest.mark.parametrize("offset", [0, 1])
def test_a_lookup_that_misses_is_set_aside_and_one_that_hits_drafts_every_pass(offset):
    target, draft = tiny_llama(0), tiny_llama(0, noise=0.02)
    plain = generate_all(target, PROMPTS_1, GREEDY_LONG)
    stats = SpecStats()
    drafter = CombinedDrafter(_Scripted(plain[0], offset, target.config.vocab_size), ModelDrafter(draft))
    assert generate_all(target, PROMPTS_1, GREEDY_LONG, drafter, k=3, stats=stats) == plain
    if offset == 0:  # every first token committed: the lookup drafts alone, every pass
        assert drafter.lookup_passes == stats.target_passes and stats.accepted == stats.proposed
    else:  # two misses, then the model's measured acceptance is higher
        assert drafter.lookup_passes == 2 and stats.accepted > 0
