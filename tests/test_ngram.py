"""Prompt lookup drafting (`verispec.drafters.ngram`).

- Unit: the proposal continues the LATEST earlier occurrence of the LONGEST matching n-gram;
  padding (periodic copy, last token repeated when nothing matches); rows are independent;
  k = 0 gives [B, 0]; the history equals prompt + committed tokens after every commit
  (all accepted, rejections, inactive rows untouched), also when driven by the engine.
- Exactness through the engine: the joint distribution of a 3-token continuation of the order-2
  Markov toy (V = 5) under a prompt with repeats, chi-square at a 1e-9 false-failure rate, k in
  {1, 2, 4}; greedy output equals plain greedy with a tiny float32 Llama, batch 1 and ragged 4.
- Prediction: with the shares of passes that proposed nothing (no match), the refined model's
  tokens per pass equal the measured mean.
- Usefulness: on a target that copies a cycle present in the prompt, acceptance >= 0.8.
- Negative control: the n-gram proposal declared with a uniform q (instead of one-hot) fails.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_engine import (
    JOINT_N,
    JOINT_TOKENS,
    NEGATIVE_N,
    PROMPTS_1,
    PROMPTS_4,
    T1,
    DeclaresUniform,
    _assert_joint_fails,
    assert_joint_exact,
    tiny_llama,
)
from test_engine import _joint_counts as engine_joint_counts
from test_policy import Scripted
from toy_models import MarkovLM

from verispec.config import SamplingParams
from verispec.drafters.base import Drafter
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.engine import generate, generate_all
from verispec.stats import SpecStats

ANY = SamplingParams()  # the drafter ignores sampling settings


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def _propose(histories: list[list[int]], k: int, **kwargs) -> list[list[int]]:
    drafter = PromptLookupDrafter(**kwargs)
    drafter.start(histories, max_length=64)
    draft_token_ids, draft_probs = drafter.propose(k, ANY)
    assert draft_probs is None and draft_token_ids.dtype == torch.long
    assert draft_token_ids.shape in ((len(histories), k), (len(histories), 0))
    return draft_token_ids.tolist()


# ---------------------------------------------------------------------------------------------
# Unit
# ---------------------------------------------------------------------------------------------

LONGEST = [1, 2, 3, 4, 8, 2, 3, 5, 9, 1, 2, 3]  # "1 2 3" at 0 (then 4); "2 3" latest at 5 (then 5)
LATEST = [1, 2, 3, 4, 7, 1, 2, 3, 6, 0, 1, 2, 3]  # "1 2 3" at 0 (then 4) and at 5 (then 6)
CYCLE = [5, 6, 7, 5, 6]  # "5 6" at 0, followed by only 3 known tokens: 7 5 6, then the copy runs on
NO_MATCH = [1, 2, 3]


def test_protocol_and_arguments():
    assert isinstance(PromptLookupDrafter(), Drafter)
    for kwargs, name in [
        ({"max_ngram": 0}, "max_ngram"),
        ({"min_ngram": 0}, "min_ngram"),
        ({"max_ngram": 2, "min_ngram": 3}, "max_ngram"),
        ({"max_ngram": 2.0}, "max_ngram"),
    ]:
        with pytest.raises(ValueError, match=name):
            PromptLookupDrafter(**kwargs)


def test_proposal_continues_the_latest_occurrence_of_the_longest_ngram():
    assert _propose([LONGEST], 4) == [[4, 8, 2, 3]]  # the 3-gram wins over a later 2-gram
    assert _propose([LONGEST], 4, max_ngram=2) == [[5, 9, 1, 2]]  # the 2-gram alone: its latest occurrence
    assert _propose([LATEST], 4) == [[6, 0, 1, 2]]  # of two occurrences, the latest
    assert _propose([[9, 3, 9, 8, 3]], 2) == [[9, 8]]  # n = 1 when nothing longer matches
    assert _propose([[4, 4, 4]], 3) == [[4, 4, 4]]  # overlapping occurrences count


def test_padding_when_the_match_is_short_or_missing():
    assert _propose([CYCLE], 7) == [[7, 5, 6, 7, 5, 6, 7]]  # periodic copy past the end of the history
    assert _propose([NO_MATCH, CYCLE], 3)[0] == [3, 3, 3]  # no match in this row: its last token repeated
    assert _propose([NO_MATCH], 3) == [[]]  # no match in any row: nothing proposed (a plain step)
    assert _propose([[8]], 2) == [[]]  # a one-token prompt has nothing earlier to match
    assert _propose([[1, 2, 3, 1]], 3, min_ngram=2) == [[]]  # the 1-gram is below min_ngram
    assert _propose([[1, 2, 3, 1], CYCLE], 3, min_ngram=2)[0] == [1, 1, 1]
    # deterministic: the same history gives the same proposal
    assert _propose([LATEST, CYCLE], 5) == _propose([LATEST, CYCLE], 5)


def test_rows_are_independent_and_k0_is_empty():
    histories = [LONGEST, CYCLE, NO_MATCH, LATEST, [8]]  # ragged
    batched = _propose(histories, 5)
    # alone, a row with no match proposes nothing; in a batch with matches it is padded
    assert batched == [_propose([h, LATEST], 5)[0] for h in histories]
    drafter = PromptLookupDrafter()
    drafter.start(histories, max_length=32)
    draft_token_ids, draft_probs = drafter.propose(0, ANY)
    assert draft_token_ids.shape == (5, 0) and draft_token_ids.dtype == torch.long and draft_probs is None


def test_history_is_prompt_plus_committed_tokens():
    """Random steps (k = 0..4, all accepted, rejections, inactive rows), including growth past
    max_length, against a reference of Python lists."""
    rng = random.Random(0)
    prompts = [[1, 2, 1, 2], [3], [4, 5, 6, 4, 5], [7, 7]]
    drafter = PromptLookupDrafter(max_ngram=2)
    drafter.start(prompts, max_length=8)
    reference = [list(p) for p in prompts]
    for step in range(40):
        k = rng.choice([0, 1, 2, 4])
        proposal, _ = drafter.propose(k, ANY)
        k = proposal.shape[1]  # fewer when no row matched (the engine does the same)
        accepted = [k if step % 3 == 0 else rng.randint(0, k) for _ in prompts]  # every third step: all accepted
        next_token_ids = torch.tensor([rng.randrange(9) for _ in prompts])
        active = [rng.random() < 0.7 for _ in prompts]
        drafter.commit(accepted, next_token_ids, active)
        for b, live in enumerate(active):
            if live:
                reference[b] += proposal[b, : accepted[b]].tolist() + [int(next_token_ids[b])]
        assert [drafter.history(b) for b in range(len(prompts))] == reference, step
    assert max(map(len, reference)) > 8  # the buffer grew


def test_history_tracks_the_engine(markov):
    """Driven by the engine (k changing, k = 0 included): after each chunk a running row's history is
    its prompt + every token yielded so far; a finished row's history no longer changes."""
    target, _ = markov
    prompts = [[3, 1, 4, 1, 3], [2], [0, 0, 0, 1], [4, 2, 4, 2, 4, 2]]
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=25)
    drafter = PromptLookupDrafter()
    outputs, frozen = [[] for _ in prompts], {}
    for chunk in generate(target, prompts, params, drafter, k=Scripted([2, 0, 3, 1, 0, 4])):
        for b, tokens in enumerate(chunk):
            if b in frozen:
                assert drafter.history(b) == frozen[b]
                continue
            before = prompts[b] + outputs[b]
            outputs[b] += tokens
            if len(outputs[b]) < params.max_new_tokens:
                assert drafter.history(b) == prompts[b] + outputs[b]
            else:  # finished at this step: nothing committed to the drafter
                assert drafter.history(b) == before
                frozen[b] = before
    assert len(frozen) == len(prompts)


# ---------------------------------------------------------------------------------------------
# Exactness through the engine
# ---------------------------------------------------------------------------------------------

REPEAT_PROMPT = [3, 1, 4, 1, 3, 1, 4]  # "3 1 4" and "1 4" recur: proposals match from the first step
TOPK_TOPP = dict(temperature=0.8, top_k=4, top_p=0.9)


def _joint_counts(target, drafter, params: SamplingParams, k: int, n: int):
    return engine_joint_counts(target, drafter, params, k, n, prompt=REPEAT_PROMPT)


@pytest.mark.parametrize(
    "setting, k",
    [
        pytest.param(T1, 1, id="T1-k1"),
        pytest.param(T1, 2, id="T1-k2"),
        pytest.param(T1, 4, id="T1-k4"),
        pytest.param(TOPK_TOPP, 4, id="T0.8-topk4-topp0.9-k4"),
    ],
)
def test_joint_distribution_of_three_tokens_is_exact(markov, setting, k):
    target, _ = markov
    params = SamplingParams(**setting, seed=2000 + k, max_new_tokens=JOINT_TOKENS)
    label = f"{setting} k={k} prompt lookup"
    stats = assert_joint_exact(target, PromptLookupDrafter(), params, k, JOINT_N, REPEAT_PROMPT, label)
    assert stats.accepted_by_position[min(k, JOINT_TOKENS) - 1] > 0  # whole blocks accepted too


def test_negative_control_one_hot_proposal_declared_uniform(markov):
    target, _ = markov
    params = SamplingParams(**T1, seed=9, max_new_tokens=JOINT_TOKENS)
    counts, _ = _joint_counts(target, DeclaresUniform(PromptLookupDrafter(), target.vocab_size), params, 2, NEGATIVE_N)
    _assert_joint_fails(counts, target.continuation_probs(REPEAT_PROMPT, JOINT_TOKENS, params))


GREEDY_LONG = SamplingParams(temperature=0, max_new_tokens=120)  # long enough for some matches


@pytest.fixture(scope="module")
def greedy_target():
    target = tiny_llama(0)
    return target, {str(p): generate_all(target, p, GREEDY_LONG, drafter=None) for p in (PROMPTS_1, PROMPTS_4)}


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("prompts", [PROMPTS_1, PROMPTS_4], ids=["batch1", "batch4"])
def test_speculative_greedy_equals_plain_greedy(greedy_target, prompts, k):
    target, plain = greedy_target
    stats = SpecStats()
    assert generate_all(target, prompts, GREEDY_LONG, PromptLookupDrafter(), k=k, stats=stats) == plain[str(prompts)]
    assert 0 < stats.accepted < stats.proposed, stats.summary()  # both paths taken


# ---------------------------------------------------------------------------------------------
# Usefulness: a target that copies
# ---------------------------------------------------------------------------------------------

CYCLE_ORDER = [0, 3, 5, 1, 7, 2, 6, 4]  # the target's next token after t is the one after t here


def copy_target() -> MarkovLM:
    """An order-2 Markov LM (V = 8) that continues CYCLE_ORDER with probability ~0.9999."""
    table = torch.zeros(8, 8, 8)
    for i, token in enumerate(CYCLE_ORDER):
        table[:, token, CYCLE_ORDER[(i + 1) % 8]] = 12.0
    return MarkovLM(table=table)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_acceptance_is_high_when_the_target_repeats_the_prompt(temperature):
    """Each prompt holds the cycle once (from different starting points): the drafter copies it."""
    prompts = [CYCLE_ORDER[s:] + CYCLE_ORDER[:s] + CYCLE_ORDER[s : s + 2] for s in (0, 3, 5, 6)]
    params = SamplingParams(temperature=temperature, seed=11, max_new_tokens=48)
    stats = SpecStats()
    outputs = generate_all(copy_target(), prompts, params, PromptLookupDrafter(), k=6, stats=stats)
    assert all(len(row) == 48 for row in outputs)
    assert stats.alpha_hat >= 0.8, stats.summary()
    assert stats.mean_tokens_per_pass >= 5.0, stats.summary()  # of at most k + 1 = 7


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plain_passes_without_a_match_enter_the_predicted_tokens_per_pass(temperature):
    """Batch 1, the copy target from the start of its cycle: no match until the cycle comes
    round, a plain pass each step. With the measured shares of passes that propose 0 and k
    tokens, the refined model's expected tokens per pass is the measured mean (an identity of
    the counts); E_k alone, as if every pass proposed k tokens, overstates it."""
    from verispec.theory import expected_tokens_per_position, mixed_speedup

    stats, k = SpecStats(), 4
    params = SamplingParams(temperature=temperature, seed=2, max_new_tokens=40)
    generate_all(copy_target(), [CYCLE_ORDER[:2]], params, PromptLookupDrafter(), k=k, stats=stats)
    shares, alphas = stats.proposal_length_shares, stats.acceptance_by_position
    assert len(shares) == k + 1 and shares[0] > 0 and shares[k] > 0 and sum(shares[1:k]) == 0, shares
    assert shares[0] == (stats.target_passes - stats.proposed // k) / stats.target_passes
    mixed = sum(w * expected_tokens_per_position(alphas[:j]) for j, w in enumerate(shares))
    assert mixed == pytest.approx(stats.mean_tokens_per_pass, rel=1e-12)
    assert mixed_speedup(alphas, 0.0, [1.0] * (k + 1), shares) == pytest.approx(mixed, rel=1e-12)  # free draft, r = 1
    assert expected_tokens_per_position(alphas) > stats.mean_tokens_per_pass * 1.05  # the old prediction
