"""Suffix drafting (`verispec.drafters.suffix`).

- Unit: the proposal continues the longest earlier match of the row's suffix by its most frequent
  continuation (frequency over recency, ties to the most recent), stops before the path's score
  falls below min_score and at min(k, ceil(match_factor * match length)); padding; k = 0 and no
  match give [B, 0]; the lookup through the index equals a brute-force search over the history
  and the corpus (random histories, evictions included); the history is prompt + committed tokens.
- Corpus: bounded by its token budget, oldest request evicted first; a second request in one
  engine.Batch whose output repeats the first's is drafted from the corpus (tokens per pass far
  above 1), and without a corpus (budget 0) it is not (the control); a server's calibration
  leaves no synthetic request in it.
- Exactness through the engine: the joint distribution of a 3-token continuation of the order-2
  Markov toy, chi-square at a 1e-9 false-failure rate (with a negative control: the proposal
  declared with a uniform q); greedy output equals plain greedy (tiny float32 Llama, batch 1 and
  ragged 4); seeded sampling gives the tokens of plain sampling with the same seeds, rows leaving
  at different times so that the corpus drafts for the rest (control: a draft model's random
  proposals change them).
- plan: the teacher-forced replay proposes what the engine proposes from each prefix.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from test_engine import (
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
from test_ngram import TOPK_TOPP
from test_policy import Scripted

from verispec.config import SamplingParams
from verispec.drafters.base import Drafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.suffix import SuffixDrafter
from verispec.engine import Batch, generate, generate_all
from verispec.stats import SpecStats

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def _propose(histories: list[list[int]], k: int, **kwargs) -> list[list[int]]:
    drafter = SuffixDrafter(**kwargs)
    drafter.start(histories, max_length=64)
    draft_token_ids, draft_probs = drafter.propose(k, None)
    assert draft_probs is None and draft_token_ids.dtype == torch.long
    assert draft_token_ids.shape[0] == len(histories) and draft_token_ids.shape[1] <= k
    return draft_token_ids.tolist()


# ---------------------------------------------------------------------------------------------
# Unit
# ---------------------------------------------------------------------------------------------

REPEAT = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # "1 2 3" matched (3 tokens), then 4 5 6 7 1 2 3 ...
FREQUENT = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]  # after "1 2 3": 9 three times, 8 last
TIE = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]  # after "1 2 3": 9 once, 8 once (the latest)
LONGER = [5, 1, 2, 3, 7, 6, 1, 2, 3, 9, 6, 1, 2, 3, 9, 5, 1, 2, 3]  # "5 1 2 3" once (then 7); "1 2 3" more often 9
HALVES = [1, 2, 3, 4, 8, 1, 2, 3, 4, 9, 1, 2, 3]  # then 4 (2 of 2), then 8 or 9 (1 of 2 each)
CYCLE = [5, 6, 7, 5, 6]  # the own history runs into its end: the copy goes on
NO_MATCH = [1, 2, 3]


def test_protocol_and_arguments():
    assert isinstance(SuffixDrafter(), Drafter)
    for kwargs, name in [
        ({"min_match": 0}, "min_match"),
        ({"max_match": 1}, "max_match"),  # below min_match = 2
        ({"min_score": 1.5}, "min_score"),
        ({"match_factor": 0}, "match_factor"),
        ({"max_candidates": 0}, "max_candidates"),
        ({"max_corpus_tokens": -1}, "max_corpus_tokens"),
        ({"max_corpus_tokens": 2.0}, "max_corpus_tokens"),
    ]:
        with pytest.raises(ValueError, match=name):
            SuffixDrafter(**kwargs)


def test_draft_suffix_loads_a_suffix_drafter():
    from verispec.assemble import Settings, load_drafter

    drafter = load_drafter(Settings(target="unused", draft="suffix"), tiny_llama(0))
    assert isinstance(drafter, SuffixDrafter) and drafter.device == torch.device("cpu")
    assert Settings(target="unused", draft="suffix").draft_spec == "suffix"


def test_the_proposal_continues_the_match_as_far_as_its_length_allows():
    assert _propose([REPEAT], 8) == [[4, 5, 6]]  # match of 3, match_factor 1: 3 tokens
    assert _propose([REPEAT], 8, match_factor=2.0) == [[4, 5, 6, 7, 1, 2]]  # ceil(2 * 3) = 6
    assert _propose([REPEAT], 2, match_factor=2.0) == [[4, 5]]  # capped by k
    assert _propose([REPEAT], 8, match_factor=0.5) == [[4, 5]]  # ceil(1.5) = 2
    assert _propose([REPEAT], 8, max_match=2) == [[4, 5]]  # the match itself capped at 2 tokens
    assert _propose([CYCLE], 8, match_factor=4.0) == [[7, 5, 6, 7, 5, 6, 7, 5]]  # past the end: the copy goes on


def test_frequency_wins_over_recency_and_ties_go_to_the_most_recent():
    assert _propose([FREQUENT], 8) == [[9, 1, 2]]  # 9 (3 of 4) although 8 followed the latest occurrence
    flipped = [8 if t == 9 else 9 if t == 8 else t for t in FREQUENT]
    assert _propose([flipped], 8) == [[8, 1, 2]]  # the same with the roles exchanged
    assert _propose([TIE], 8) == [[8, 1, 2]]  # 1 of 2 each: the latest
    assert _propose([LONGER], 8) == [[7, 6, 1, 2]]  # the longest match first ("5 1 2 3": 4 tokens), then frequency


def test_the_score_threshold_stops_the_path():
    assert _propose([HALVES], 8, min_score=0.6) == [[4]]  # 4 (score 1), then 9 would score 0.5
    assert _propose([HALVES], 8, min_score=0.5) == [[4, 9, 1]]  # 9: the tie's most recent; length 3
    four_ways = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 3, 7, 1, 2, 3]
    assert _propose([four_ways], 8, min_score=0.3) == [[]]  # the first token scores 0.25: nothing
    assert _propose([four_ways], 8, min_score=0.25) == [[7, 1, 2]]


def test_padding_k0_and_no_match():
    assert _propose([NO_MATCH], 3) == [[]]  # no match in any row: nothing proposed (a plain step)
    assert _propose([[8]], 2) == [[]]  # a one-token prompt has nothing earlier to match
    assert _propose([[1, 2, 3, 1]], 3) == [[]]  # a 1-token match is below min_match = 2
    assert _propose([[1, 2, 3, 1]], 3, min_match=1) == [[2]]
    # in a batch, a row with no match repeats its last token; a shorter proposal goes on with its walk
    assert _propose([NO_MATCH, REPEAT], 4) == [[3, 3, 3], [4, 5, 6]]
    assert _propose([HALVES, REPEAT], 4, min_score=0.6) == [[4, 9, 1], [4, 5, 6]]
    # rows are independent: each row's proposal alone is a prefix of its padded one
    rows = [REPEAT, FREQUENT, TIE, LONGER, CYCLE, NO_MATCH]
    batched = _propose(rows, 8)
    for row, alone in zip(batched, (_propose([r], 8)[0] for r in rows)):
        assert row[: len(alone)] == alone
    drafter = SuffixDrafter()
    drafter.start(rows, 64)
    draft_token_ids, draft_probs = drafter.propose(0, None)
    assert draft_token_ids.shape == (len(rows), 0) and draft_probs is None


def _brute_force_match(history: list[int], corpus: list[list[int]], min_match: int, max_match: int):
    """The longest suffix of `history` (min_match..max_match) followed by a token earlier in it or in
    a corpus sequence, and the set of its occurrences (sequence number, position after it); -1: own."""
    best, found = 0, set()
    for number, sequence in [(-1, history)] + list(enumerate(corpus)):
        last = len(history) - 1 if number == -1 else len(sequence) - 1  # an occurrence needs a token after it
        for position in range(min_match, last + 1):
            matched = 0
            while matched < min(max_match, position, len(history)) and (
                sequence[position - 1 - matched] == history[len(history) - 1 - matched]
            ):
                matched += 1
            if matched < min_match:
                continue
            if matched > best:
                best, found = matched, set()
            if matched == best:
                found.add((number, position))
    return best, found


def test_the_index_finds_what_a_brute_force_search_finds():
    """Random histories over 4 tokens and a corpus of random requests under a small budget (many
    evictions); max_candidates large enough to see every occurrence."""
    rng = random.Random(1)
    for trial in range(60):
        drafter = SuffixDrafter(max_corpus_tokens=60, max_candidates=10_000, max_match=5)
        requests = [[rng.randrange(4) for _ in range(rng.randint(1, 25))] for _ in range(rng.randint(0, 8))]
        drafter.start(requests, 64)
        drafter.keep_rows([])  # every request joins the corpus, in order; the oldest leave
        kept, eligible = [s.tokens for s in drafter.corpus.sequences], [r for r in requests if len(r) > 2]
        assert kept == eligible[len(eligible) - len(kept) :] and sum(map(len, kept)) <= 60  # the newest
        assert len(kept) == len(eligible) or sum(map(len, eligible[len(eligible) - len(kept) - 1 :])) > 60
        history = [rng.randrange(4) for _ in range(rng.randint(2, 30))]
        drafter.add_rows([history])
        best, occurrences = drafter.match(drafter.rows[0])
        numbers = {id(s.tokens): n for n, s in enumerate(drafter.corpus.sequences)}
        got = {(-1 if s is drafter.rows[0].tokens else numbers[id(s)], p) for s, p in occurrences}
        assert (best, got) == _brute_force_match(history, kept, 2, 5), trial


def test_history_is_prompt_plus_committed_tokens():
    """Random steps (k = 0..4, all accepted, rejections, inactive rows) against Python lists."""
    rng = random.Random(0)
    prompts = [[1, 2, 1, 2], [3], [4, 5, 6, 4, 5], [7, 7]]
    drafter = SuffixDrafter(match_factor=4.0)
    drafter.start(prompts, max_length=8)
    reference = [list(p) for p in prompts]
    for step in range(40):
        proposal, _ = drafter.propose(rng.choice([0, 1, 2, 4]), None)
        k = proposal.shape[1]
        accepted = [k if step % 3 == 0 else rng.randint(0, k) for _ in prompts]
        next_token_ids = torch.tensor([rng.randrange(9) for _ in prompts])
        active = [rng.random() < 0.7 for _ in prompts]
        drafter.commit(accepted, next_token_ids, active)
        for b, live in enumerate(active):
            if live:
                reference[b] += proposal[b, : accepted[b]].tolist() + [int(next_token_ids[b])]
        assert [drafter.history(b) for b in range(len(prompts))] == reference, step


def test_history_tracks_the_engine():
    """Driven by the engine (k changing, k = 0 included), rows leaving as they finish: a running
    row's history is its prompt + every token yielded so far; a finished row joins the corpus."""
    target = tiny_llama(0)
    prompts = [[3, 1, 4, 1, 3], [2], [0, 0, 0, 1], [4, 2, 4, 2, 4, 2]]
    params = [SamplingParams(temperature=1.0, seed=3 + b, max_new_tokens=10 + 5 * b) for b in range(4)]
    drafter, outputs = SuffixDrafter(), [[] for _ in prompts]
    for chunk in generate(target, prompts, params, drafter, k=Scripted([2, 0, 3, 1, 0, 4])):
        for b, tokens in enumerate(chunk):
            outputs[b] += tokens
        running = [b for b in range(len(prompts)) if len(outputs[b]) < params[b].max_new_tokens]
        assert [drafter.history(row) for row in range(len(drafter.rows))] == [prompts[b] + outputs[b] for b in running]
        assert len(drafter.corpus.sequences) == len(prompts) - len(running)
    assert len(drafter.rows) == 0


# ---------------------------------------------------------------------------------------------
# The corpus
# ---------------------------------------------------------------------------------------------


def test_the_corpus_keeps_its_budget_and_evicts_the_oldest_first():
    requests = [[10 + i, 20 + i, 30 + i, 40 + i, 50 + i] * 2 for i in range(3)]  # 10 tokens each
    drafter = SuffixDrafter(max_corpus_tokens=25)
    drafter.start(requests, 64)
    drafter.keep_rows([1])  # requests 0 and 2 leave: 0 joins first, so 2 is the newer
    assert [s.tokens for s in drafter.corpus.sequences] == [requests[0], requests[2]]
    drafter.keep_rows([])  # request 1 joins: 30 tokens > 25, so request 0 is evicted
    assert [s.tokens for s in drafter.corpus.sequences] == [requests[2], requests[1]]
    assert drafter.corpus.tokens == 20
    drafter.add_rows([[7, 10, 20], [7, 11, 21], [7, 12, 22]])  # each matches one request's start
    proposal, _ = drafter.propose(4, None)
    assert proposal.tolist() == [[20, 20], [31, 41], [32, 42]]  # request 0 is gone: row 0 pads
    drafter.keep_rows([])
    long = list(range(100, 140))
    drafter.start([long], 64)
    drafter.keep_rows([])
    assert [s.tokens for s in drafter.corpus.sequences] == [long[-25:]]  # too long: its last 25 tokens
    none = SuffixDrafter(max_corpus_tokens=0)
    none.start(requests, 64)
    none.keep_rows([])
    assert none.corpus.tokens == 0 and not none.corpus.newest


def test_start_begins_a_new_corpus_unless_asked_to_keep_it():
    for keep in (False, True):
        drafter = SuffixDrafter(keep_corpus=keep)
        drafter.start([REPEAT], 64)
        drafter.start([[9, 1, 2]], 64)  # with keep_corpus the first batch's row joins the corpus now
        assert drafter.propose(4, None)[0].tolist() == ([[3, 4]] if keep else [[]])


def test_clear_corpus_forgets_the_rows_running_now_too():
    """A benchmark's rounds: after clear_corpus the previous round's last rows must not join the next corpus."""
    for clear in (False, True):  # without the clear (the negative control) the old row is proposed from
        drafter = SuffixDrafter(keep_corpus=True)
        drafter.start([REPEAT], 64)
        if clear:
            drafter.clear_corpus()
        drafter.start([[9, 1, 2]], 64)
        assert drafter.propose(4, None)[0].tolist() == ([[]] if clear else [[3, 4]])
        drafter.keep_rows([])  # rows that start after the clear join the corpus as usual
        drafter.start([[9, 1, 2]], 64)
        assert drafter.corpus.tokens == 3 + (0 if clear else len(REPEAT))


def test_bench_rounds_do_not_share_a_corpus():
    """bench runs the same drafter object in every round: each round starts from an empty corpus."""
    from verispec.analysis.bench import _timed

    class Recorder(SuffixDrafter):
        def start(self, prompts, max_length):
            self.sizes.append(self.corpus.tokens)
            super().start(prompts, max_length)

    target = tiny_llama(0)
    drafter = Recorder(keep_corpus=True)
    drafter.sizes = []
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    for _ in range(2):
        _timed(target, [REPEAT, REPEAT], params, drafter, 4)
    first, second = drafter.sizes[:2], drafter.sizes[2:]
    assert first[0] == 0 and second[0] == 0  # each round begins empty
    assert second[1] > 0  # within a round the corpus grows: the second prompt sees the first's output


def _two_requests(drafter, target, params, k: int = 6) -> list[tuple[list[int], int]]:
    """Two requests with one prompt and one seed, one after the other in one Batch (as a
    server runs them): (tokens, target passes) of each."""
    batch = Batch(target, [], [], drafter, k=k, capacity=2, compiled=False, max_length=256)
    done = []
    for request in range(2):
        batch.join([PROMPTS_1[0]], [params], [request])
        tokens, passes = [], 0
        while len(batch):
            tokens += batch.step().get(request, [])
            passes += 1
        done.append((tokens, passes))
    return done


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_that_repeats_an_earlier_one_is_drafted_from_the_corpus(temperature):
    target = tiny_llama(0)
    params = SamplingParams(temperature=temperature, seed=5, max_new_tokens=80)
    plain = generate_all(target, PROMPTS_1, params)[0]
    (first, _), (second, passes) = _two_requests(SuffixDrafter(), target, params)
    assert first == second == plain  # exact: the tokens of plain decoding
    assert len(second) / passes > 5.0  # of at most k + 1 = 7
    (first, _), (second, passes) = _two_requests(SuffixDrafter(max_corpus_tokens=0), target, params)
    assert first == second == plain
    assert len(second) / passes < 1.5  # the control: the row's own history alone barely repeats


def test_a_servers_calibration_leaves_no_request_in_the_corpus():
    from verispec.analysis.profile import calibrate
    from verispec.policy import AdaptiveLength

    drafter, policy = SuffixDrafter(), AdaptiveLength(k_max=2)
    batch = Batch(tiny_llama(0), [], [], drafter, k=policy, capacity=2, compiled=False, max_length=128)
    calibrate(batch, policy, [1, 2], max_model_len=100, repeats=1, prompt_length=8)
    assert len(batch) == 0 and drafter.corpus.tokens == 0 and not drafter.corpus.newest


# ---------------------------------------------------------------------------------------------
# Exactness through the engine
# ---------------------------------------------------------------------------------------------

# "2 1" recurs, followed by the target's most likely path from it (at T = 0.8, top-k 4, top-p 0.9: 0.46)
REPEAT_PROMPT = [2, 1, 0, 0, 4, 2, 1]


SUFFIX_JOINT_N = 40_000  # the drafter walks each row in Python: fewer rows than test_engine's JOINT_N


def _joint_counts(target, drafter, params: SamplingParams, k: int, n: int):
    return engine_joint_counts(target, drafter, params, k, n, prompt=REPEAT_PROMPT)


@pytest.mark.parametrize(
    "setting, k",
    [
        pytest.param(T1, 1, id="T1-k1"),
        pytest.param(T1, 4, id="T1-k4"),
        pytest.param(TOPK_TOPP, 4, id="T0.8-topk4-topp0.9-k4"),
    ],
)
def test_joint_distribution_of_three_tokens_is_exact(markov, setting, k):
    target, _ = markov
    params = SamplingParams(**setting, seed=3000 + k, max_new_tokens=JOINT_TOKENS)
    drafter, label = SuffixDrafter(match_factor=2.0), f"{setting} k={k} suffix"
    stats = assert_joint_exact(target, drafter, params, k, SUFFIX_JOINT_N, REPEAT_PROMPT, label)
    assert stats.accepted_by_position[min(k, JOINT_TOKENS) - 1] > 0  # whole blocks accepted too


def test_negative_control_one_hot_proposal_declared_uniform(markov):
    target, _ = markov
    params = SamplingParams(**T1, seed=9, max_new_tokens=JOINT_TOKENS)
    counts, _ = _joint_counts(
        target, DeclaresUniform(SuffixDrafter(match_factor=2.0), target.vocab_size), params, 2, NEGATIVE_N
    )
    _assert_joint_fails(counts, target.continuation_probs(REPEAT_PROMPT, JOINT_TOKENS, params))


GREEDY_LONG = SamplingParams(temperature=0, max_new_tokens=120)


@pytest.fixture(scope="module")
def greedy_target():
    target = tiny_llama(0)
    return target, {str(p): generate_all(target, p, GREEDY_LONG, drafter=None) for p in (PROMPTS_1, PROMPTS_4)}


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("prompts", [PROMPTS_1, PROMPTS_4], ids=["batch1", "batch4"])
def test_speculative_greedy_equals_plain_greedy(greedy_target, prompts, k):
    target, plain = greedy_target
    stats = SpecStats()
    assert generate_all(target, prompts, GREEDY_LONG, SuffixDrafter(), k=k, stats=stats) == plain[str(prompts)]
    assert 0 < stats.accepted < stats.proposed, stats.summary()  # both paths taken


def test_seeded_sampling_gives_the_tokens_of_plain_sampling():
    """q is one-hot, so the rule runs coupled and a row keeps one number per committed token: the
    tokens of plain sampling with the same seeds, whatever was proposed. Rows have budgets of 4..28
    tokens, so that rows leave at different times and the corpus drafts for the others. A draft
    model's proposals are random, so with it the tokens differ (the control)."""
    target = tiny_llama(0)
    prompts = [[b % 7, (b * 3) % 7, 1, 2, b % 7, (b * 3) % 7] for b in range(60)]
    base = SamplingParams(temperature=1.0, top_p=0.9)
    params = [replace(base, seed=b // 2, max_new_tokens=4 + b % 25) for b in range(60)]  # pairs share seeds
    plain = generate_all(target, prompts, params)
    stats, drafter = SpecStats(), SuffixDrafter()
    assert generate_all(target, prompts, params, drafter, k=4, stats=stats) == plain
    assert 0 < stats.accepted < stats.proposed, stats.summary()
    assert len(drafter.corpus.sequences) == len(prompts)  # every row joined the corpus as it left
    drafted = generate_all(target, prompts, params, ModelDrafter(tiny_llama(0, noise=0.5)), k=4)
    assert sum(a != b for a, b in zip(drafted, plain)) > 10


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [False, True])
def test_the_replay_proposes_what_the_engine_proposes_from_each_prefix(keep):
    sequences = [REPEAT + [4, 5, 9], FREQUENT + [9, 1], [2, 1, 2, 3, 4, 5]]
    starts = [4, 10, 2]
    replayed = SuffixDrafter(keep_corpus=keep).replay(sequences, starts, 4)
    drafter = SuffixDrafter()
    for number, (sequence, start, (proposals, lengths)) in enumerate(zip(sequences, starts, replayed)):
        assert proposals.shape == (len(sequence) - start, 4)
        for t in range(start, len(sequence)):
            drafter.rows = []
            drafter.add_rows([sequence[:t]])
            assert (proposals[t - start].tolist(), int(lengths[t - start])) == drafter.walk(drafter.rows[0], 4)
        if keep:  # as requests served one after another
            drafter.rows = []
            drafter.add_rows([sequence])
            drafter.keep_rows([])
    assert int(replayed[2][1][-1]) == (2 if keep else 0)  # "1 2 3 4" is only in an earlier sequence


# ---------------------------------------------------------------------------------------------
# serve: one batch for the server's life, so the corpus spans its requests
# ---------------------------------------------------------------------------------------------


def test_a_server_drafts_a_repeated_request_from_the_corpus():
    """The built-in target behind `verispec serve` (in a thread) with suffix drafting: a request
    sent twice returns plain greedy's text both times; the first joined the corpus as it left,
    and the second accepted more per pass than the first."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from verispec.models.backend import load, load_text_tokenizer
    from verispec.pair import TARGET_DIR
    from verispec.policy import FixedLength
    from verispec.server.run import build, start_in_thread

    target, _ = load(TARGET_DIR, "auto")
    tokenizer = load_text_tokenizer(TARGET_DIR, target)
    drafter = SuffixDrafter()
    app, scheduler = build(
        target, drafter, tokenizer, model_name="pair", k=FixedLength(4), max_batch=2, max_model_len=128, eos=()
    )
    prompt = "def quicksort(arr):"
    ids = tokenizer.encode(prompt).ids
    plain = tokenizer.decode(generate_all(target, [ids], SamplingParams(temperature=0, max_new_tokens=48))[0])
    handle = start_in_thread(app)
    try:
        body = {"model": "pair", "prompt": prompt, "max_tokens": 48, "temperature": 0}
        passes = []
        for _ in range(2):
            before = scheduler.passes
            got = httpx.post(handle.url + "/v1/completions", json=body, timeout=60).json()
            passes.append(scheduler.passes - before)
            assert got["choices"][0]["text"] == plain, got
        assert [s.tokens[: len(ids)] for s in drafter.corpus.sequences] == [ids, ids]
        assert passes[1] <= 48 / 3 < passes[0], passes
    finally:
        handle.stop()


def test_the_placeholder_guess_stops_while_its_guesses_would_not_pay_and_comes_back():
    """drafters/placeholder.py: past `guess_from` a row guesses while the share of its would-be guesses that were
    right (Laplace's rule over the last `window`) exceeds cell_cost x its length; a would-be guess is scored on
    every pass, made or not, so a row that stopped guessing starts again once its text turns predictable."""
    from verispec.drafters.placeholder import PlaceholderGuesser

    text = [1, 2, 1, 2, 1, 2, 1, 2, 1, 2]  # the guess after "... 1 2" is 1
    guesser = PlaceholderGuesser(guess_from=5, cell_cost=0.01, window=8)
    guesser.start([list(text)], max_length=200)

    def one_pass(right: bool) -> bool:
        """One plain pass committing the would-be guess (right) or the other token; whether a guess was made."""
        proposal = guesser.propose(1)[0].tolist()[0]
        would = guesser._would[0]
        token = would if right else 3 - would
        guesser.commit([1 if proposal and proposal[0] == token else 0], torch.tensor([token]), [True])
        return bool(proposal)

    assert one_pass(right=False)  # 10 tokens, (0 + 1) / (0 + 2) > 0.01 x 10: a guess
    made = [one_pass(right=False) for _ in range(7)]  # always wrong: 1 / 10 < 0.01 x 18 by the eighth
    assert guesser.accuracy(guesser.rows[0]) == pytest.approx(0.1) and not made[-1]
    assert guesser.propose(1)[0].shape == (1, 0)  # no guess: the pass keeps its placeholder
    made = [one_pass(right=True) for _ in range(8)]  # right, scored though not made, until it pays again
    assert not made[0] and made[-1]
    short = PlaceholderGuesser(guess_from=50, cell_cost=0.0)  # below guess_from: never
    short.start([list(text)], max_length=200)
    assert short.propose(1)[0].shape == (1, 0)
    free = PlaceholderGuesser(guess_from=0, cell_cost=0.0)  # a placeholder in every pass: always, right or not
    free.start([list(text)], max_length=200)
    assert free.propose(1)[0].tolist() == [[1]]


def test_a_row_far_below_guess_from_looks_nothing_up():
    """drafters/placeholder.py: a row more than `window` tokens short of `guess_from` does not walk (its would-be
    guesses could not count by the time it may guess); from `window` tokens before, it walks and scores."""
    from verispec.drafters.placeholder import PlaceholderGuesser

    guesser = PlaceholderGuesser(guess_from=50, cell_cost=0.0, window=8)
    walked = []
    walk = guesser.walk
    guesser.walk = lambda row, k: walked.append(len(row.tokens)) or walk(row, k)
    guesser.start([[1, 2] * 5, [1, 2] * 21], max_length=200)  # 10 tokens: far; 42 = 50 - 8: near
    assert guesser.propose(1)[0].shape == (2, 0)  # neither row is long enough to guess
    assert walked == [42] and guesser._would == [None, 1]
