"""Continuous batching (engine.Batch): rows join and leave between passes, exactly.

- Exactness under churn: requests for PROMPT join a batch of other requests (other prompts,
  settings and budgets) in free rows at random passes; some requests are cancelled at random
  (independently of their tokens); the completed PROMPT requests' 3-token continuations must
  match the exact joint distribution (chi-square at 1e-9, stats_helpers.py). Negative control:
  a join that pends the wrong token (the prompt's token before its last) fails.
- Greedy rows that join mid-way equal plain greedy decoding, for every drafter family and on
  llama.cpp; a seeded sampled row gives the same tokens alone and joined into a busy batch.
- Bad joins are clear errors.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from stats_helpers import assert_distributed_as, is_distributed_as
from test_exactness import (  # noqa: F401 (gguf: a fixture)
    DRAFTERS,
    PROMPT,
    SETTING,
    TOKENS,
    VOCAB,
    _exact_joint,
    gguf,
    llama,
)

from verispec.config import SamplingParams
from verispec.drafters.model import ModelDrafter
from verispec.engine import Batch, generate_all

pytestmark = pytest.mark.usefixtures("one_thread")

SLOTS = 48
OTHER_PROMPTS = [[1, 2, 3], [4], [0, 4, 4, 2, 1, 3], [3, 3]]


@pytest.fixture(scope="module")
def target():
    return llama(2, 11)


@pytest.fixture(scope="module")
def made():
    return {}


@pytest.fixture(scope="module")
def exact(target):
    return _exact_joint(target, SamplingParams(**SETTING))


def _other(rng: random.Random) -> tuple[list[int], SamplingParams]:
    """A background request: another prompt, other settings, a longer budget."""
    settings = rng.choice(
        [
            dict(temperature=0),
            dict(temperature=1.3),
            dict(temperature=0.6, top_p=0.8),
            dict(temperature=1.0, sampling="invariant"),
        ]
    )
    return rng.choice(OTHER_PROMPTS), SamplingParams(
        **settings, max_new_tokens=rng.randint(2, 9), seed=rng.randrange(2**40)
    )


def churn(model, drafter, n: int, seed: int, batch_cls=Batch, k: int = 3) -> np.ndarray:
    """Counts [V**3] of the 3-token continuations of n completed PROMPT requests, run through
    one Batch of SLOTS rows with joins at random passes, background requests and cancels."""
    rng = random.Random(seed)
    batch = batch_cls(model, [], [], drafter, k=k, capacity=SLOTS, compiled=False, max_length=32)
    kinds: dict[int, str] = {}  # id -> "probe" (a PROMPT request) or "other"
    outputs: dict[int, list[int]] = {}
    counts = np.zeros(VOCAB**TOKENS, dtype=np.int64)
    done = next_id = 0

    def left():
        nonlocal done
        for i, request in batch.finished:
            if kinds.pop(i) == "probe" and request.finish_reason == "length":
                counts[np.ravel_multi_index(outputs[i], (VOCAB,) * TOKENS)] += 1
                done += 1
            outputs.pop(i)

    while done < n:
        prompts, params, ids = [], [], []
        for _ in range(SLOTS - len(batch)):
            if rng.random() < 0.3:  # not every free row at every pass
                continue
            if rng.random() < 0.75:
                prompt, p, kind = (
                    PROMPT,
                    SamplingParams(**SETTING, max_new_tokens=TOKENS, seed=rng.randrange(2**40)),
                    "probe",
                )
            else:
                (prompt, p), kind = _other(rng), "other"
            prompts.append(prompt), params.append(p), ids.append(next_id)
            kinds[next_id], outputs[next_id], next_id = kind, [], next_id + 1
        if ids:
            batch.join(prompts, params, ids)
        batch.cancel([i for i in batch.ids if rng.random() < 0.01])  # chosen without looking at the tokens
        left()
        if not len(batch):
            continue
        for i, tokens in batch.step().items():
            outputs[i].extend(tokens)
        left()
    return counts


class PendsTheWrongToken(Batch):
    """A planted churn bug: a joining row's pending token is its prompt's token before the last."""

    def join(self, prompts, params, ids):
        super().join(prompts, params, ids)
        for offset, prompt in enumerate(prompts, start=len(self.ids) - len(prompts)):
            self.pending_ids[offset] = prompt[-2] if len(prompt) > 1 else prompt[-1]
        self.pending = torch.tensor(self.pending_ids)


@pytest.mark.parametrize("name", ["model", "ngram", "early-exit", "suffix"])
def test_joint_distribution_is_exact_under_churn(target, made, exact, name):
    counts = churn(
        target, DRAFTERS[name](target, made), 20_000, seed=700 + ["model", "ngram", "early-exit", "suffix"].index(name)
    )
    assert_distributed_as(counts, exact, are_counts=True, label=f"churn {name} {SETTING} k=3")


def test_negative_control_a_join_that_pends_the_wrong_token(target, made, exact):
    counts = churn(target, DRAFTERS["model"](target, made), 6_000, seed=790, batch_cls=PendsTheWrongToken)
    assert not is_distributed_as(counts, exact, are_counts=True)


GREEDY = SamplingParams(temperature=0, max_new_tokens=12)


def _joined_midway(model, drafter, prompts, params, k=3) -> list[list[int]]:
    """prompts[i] with params[i] joined one by one into a batch already running other requests;
    returns each one's tokens."""
    rng = random.Random(5)
    batch = Batch(model, [], [], drafter, k=k, capacity=len(prompts) + 3, compiled=False, max_length=64)
    background = [_other(rng) for _ in range(3)]
    batch.join(
        [p for p, _ in background], [replace(q, max_new_tokens=40) for _, q in background], ["bg0", "bg1", "bg2"]
    )
    outputs: dict[int, list[int]] = {}
    waiting = list(range(len(prompts)))
    while waiting or any(i in outputs for i in batch.ids):
        if waiting and rng.random() < 0.5:
            i = waiting.pop(0)
            batch.join([prompts[i]], [params[i]], [i])
            outputs[i] = []
        if not len(batch):
            continue
        for i, tokens in batch.step().items():
            if i in outputs:
                outputs[i].extend(tokens)
    batch.close()
    return [outputs[i] for i in range(len(prompts))]


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_greedy_rows_joined_midway_equal_plain_greedy(target, made, name):
    prompts = OTHER_PROMPTS + [PROMPT]
    plain = generate_all(target, prompts, GREEDY)
    assert _joined_midway(target, DRAFTERS[name](target, made), prompts, [GREEDY] * len(prompts)) == plain


def test_greedy_rows_joined_midway_on_llama_cpp(target, gguf):  # noqa: F811 (gguf: the fixture)
    gguf_target, gguf_draft = gguf["target"], gguf["draft"]
    prompts = OTHER_PROMPTS + [PROMPT]
    plain = generate_all(gguf_target, prompts, GREEDY)
    assert _joined_midway(gguf_target, ModelDrafter(gguf_draft), prompts, [GREEDY] * len(prompts)) == plain
    assert _joined_midway(gguf_target, None, prompts, [GREEDY] * len(prompts)) == plain


@pytest.mark.parametrize("name", ["model", "ngram", "suffix"])
def test_a_seeded_row_gives_the_same_tokens_alone_and_joined_into_a_busy_batch(target, made, name):
    params = [SamplingParams(temperature=1.0, top_k=4, max_new_tokens=20, seed=1000 + i) for i in range(4)]
    prompts = [PROMPT, [1, 2, 3], PROMPT, [4]]
    alone = [generate_all(target, [p], q, DRAFTERS[name](target, made), k=3)[0] for p, q in zip(prompts, params)]
    assert _joined_midway(target, DRAFTERS[name](target, made), prompts, params) == alone
    assert len({tuple(a) for a in alone}) == 4  # the rows really are sampled


def test_bad_joins_are_clear_errors(target, made):
    batch = Batch(target, [], [], DRAFTERS["model"](target, made), k=2, capacity=2, compiled=False, max_length=32)
    batch.join([PROMPT], [GREEDY], ["a"])
    with pytest.raises(ValueError, match="ids must be distinct"):
        batch.join([PROMPT], [GREEDY], ["a"])
    with pytest.raises(ValueError, match="holds 2 rows; 1 run, 0 are staged and 2 asked to join"):
        batch.join([PROMPT, PROMPT], [GREEDY, GREEDY], ["b", "c"])
    with pytest.raises(ValueError, match="exceeds the batch's max_length"):
        batch.join([PROMPT], [replace(GREEDY, max_new_tokens=40)], ["b"])
    with pytest.raises(ValueError, match="prompts\\[0\\] is empty"):
        batch.join([[]], [GREEDY], ["b"])
    with pytest.raises(ValueError, match="one SamplingParams and one id per prompt"):
        batch.join([PROMPT], [GREEDY], [])
    assert batch.ids == ["a"] and len(batch.cache.host_lengths) == 1  # nothing changed
    batch.join([PROMPT], [GREEDY], ["b"])
    assert batch.ids == ["a", "b"]
    batch.cancel(["a"])
    assert batch.ids == ["b"] and [i for i, _ in batch.finished] == ["a"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_targets_raw_log_probabilities_of_the_committed_tokens(target, made, temperature):
    params = SamplingParams(temperature=temperature, max_new_tokens=10, seed=3)
    batch = Batch(target, [], [], DRAFTERS["model"](target, made), k=3, capacity=3, compiled=False, max_length=32)
    batch.join([PROMPT, [1, 2, 3]], [params, params], ["with", "without"], logprobs=[2, None])
    tokens, logprobs = [], []
    while "with" in batch.ids:
        tokens += batch.step().get("with", [])
        assert "without" not in batch.last_logprobs
        logprobs += batch.last_logprobs.get("with", [])
    assert len(logprobs) == len(tokens) == 10
    with torch.no_grad():
        reference = torch.log_softmax(
            target(torch.tensor([PROMPT + tokens]))[0, len(PROMPT) - 1 : -1].float(), dim=-1
        )  # [10, V]
    for j, (token, (chosen, top)) in enumerate(zip(tokens, logprobs)):
        assert chosen == pytest.approx(float(reference[j, token]), abs=1e-5)
        assert len(top) == 2 and max(top.values()) == pytest.approx(float(reference[j].max()), abs=1e-5)
        if temperature == 0:
            assert chosen == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the chosen token is the most likely


def _staged_midway(model, drafter, prompts, params, piece: int = 2, k: int = 3) -> list[list[int]]:
    """As _joined_midway, but each prompt is read `piece` tokens per pass into a reserved row
    (Batch.reserve / feed / join_staged) while the other requests run."""
    rng = random.Random(6)
    batch = Batch(model, [], [], drafter, k=k, capacity=len(prompts) + 3, compiled=False, max_length=64)
    background = [_other(rng) for _ in range(2)]
    batch.join([p for p, _ in background], [replace(q, max_new_tokens=40) for _, q in background], [-1, -2])
    outputs: dict[int, list[int]] = {}
    waiting, staging = list(range(len(prompts))), []  # staging: [index, Staged]
    while waiting or staging or any(i in outputs for i in batch.ids):
        if waiting and len(staging) < 2:
            staging.append([waiting.pop(0), batch.reserve()])
        for entry in staging[:1]:  # one piece per pass
            i, staged = entry
            body = prompts[i][:-1]
            if staged.fed < len(body):
                batch.feed(staged, body[staged.fed : staged.fed + piece])
            if staged.fed == len(body):
                batch.join_staged(staged, prompts[i], params[i], i)
                outputs[i] = []
                staging.remove(entry)
        if not len(batch):
            continue
        for i, tokens in batch.step().items():
            if i in outputs:
                outputs[i].extend(tokens)
    return [outputs[i] for i in range(len(prompts))]


@pytest.mark.parametrize("name", ["model", "early-exit", "ngram", "suffix", "hf-gpt2"])
def test_prompts_read_piece_by_piece_before_joining_give_plain_greedy(target, made, name):
    prompts = [PROMPT + [1, 3, 0, 2], [0, 4, 4, 2, 1, 3], [3, 3, 1]]
    plain = generate_all(target, prompts, GREEDY)
    assert (
        Batch(target, [], [], DRAFTERS[name](target, made), k=3, capacity=2, compiled=False, max_length=64).reserve()
        is not None
    )
    assert _staged_midway(target, DRAFTERS[name](target, made), prompts, [GREEDY] * len(prompts)) == plain


def test_prompts_read_piece_by_piece_on_llama_cpp(gguf):  # noqa: F811 (gguf: the fixture)
    prompts = [PROMPT + [1, 3, 0, 2], [0, 4, 4, 2, 1, 3], [3, 3, 1]]
    plain = generate_all(gguf["target"], prompts, GREEDY)
    assert _staged_midway(gguf["target"], ModelDrafter(gguf["draft"]), prompts, [GREEDY] * len(prompts)) == plain
    assert _staged_midway(gguf["target"], None, prompts, [GREEDY] * len(prompts)) == plain


class _PlainThen:
    """A policy: plain passes first (`plain` of them), then k = 3."""

    k_max = 3

    def __init__(self, plain: int):
        self.plain = plain

    def choose(self, batch: int = 1) -> int:
        self.plain -= 1
        return 0 if self.plain >= 0 else 3

    def observe(self, *args, **kwargs) -> None:
        pass


def _self_drafted(model, monkeypatch) -> tuple[list[int], int]:
    """Rows join a batch that decodes plain, with the target as its own draft; then it drafts.
    Returns each drafting pass's accepted count per row (all 3 when the draft's state is right)
    and how many draft passes ran while the batch was plain."""
    drafter = ModelDrafter(model)
    calls = []
    monkeypatch.setattr(
        drafter, "read_joined", lambda read=drafter.read_joined: (calls.append(drafter.joined_unread), read())[1]
    )
    batch = Batch(model, [], [], drafter, k=_PlainThen(4), capacity=4, compiled=False, max_length=64)
    params = SamplingParams(temperature=0, max_new_tokens=30)
    batch.join([[1, 2, 3, 0, 4, 4, 2]], [params], ["a"])
    batch.step()
    batch.join([[0, 4, 4, 2, 1, 3, 3, 1], [3, 3, 1, 0, 2]], [params, params], ["b", "c"])
    for _ in range(3):
        batch.step()
    plain_reads = len(calls)
    accepted = []
    for _ in range(4):
        batch.step()
        accepted += list(batch.last_accepted.values())
    assert calls[plain_reads] == 6 + 7 + 4  # the three prompts' bodies, read at the first drafting pass
    return accepted, plain_reads


@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_a_draft_reads_joined_prompts_only_when_it_drafts(target, gguf, backend, monkeypatch):  # noqa: F811 (gguf: the fixture)
    """Joins under plain passes cost the draft nothing; once it drafts, its state is what an
    eager read gives: the target drafting for itself has every proposal accepted."""
    accepted, plain_reads = _self_drafted(target if backend == "torch" else gguf["target"], monkeypatch)
    assert plain_reads == 0
    assert accepted == [3] * 12


def test_negative_control_a_draft_that_skips_the_joined_prompts(target, monkeypatch):
    monkeypatch.setattr(ModelDrafter, "read_joined", lambda self: setattr(self, "_unread", [None] * len(self._unread)))
    accepted, _ = _self_drafted(target, monkeypatch)
    assert accepted != [3] * 12


def test_a_staged_row_counts_against_the_capacity_and_can_be_given_up(target, made):
    batch = Batch(target, [], [], DRAFTERS["model"](target, made), k=2, capacity=2, compiled=False, max_length=32)
    staged = batch.reserve()
    batch.join([PROMPT], [GREEDY], ["a"])
    with pytest.raises(ValueError, match="1 run, 1 are staged"):
        batch.join([PROMPT], [GREEDY], ["b"])
    batch.release(staged)
    batch.join([PROMPT], [GREEDY], ["b"])
    assert batch.ids == ["a", "b"]


def test_a_transformers_target_takes_rows_midway(made):
    from test_exactness import _gpt2_draft

    hf_target = made.setdefault(
        "gpt2", _gpt2_draft()
    )  # any transformers causal LM (HFCache: keep_rows, add_rows; no reserved rows)
    prompts = OTHER_PROMPTS + [PROMPT]
    plain = generate_all(hf_target, prompts, GREEDY)
    assert _joined_midway(hf_target, ModelDrafter(llama(1, 12)), prompts, [GREEDY] * len(prompts)) == plain
    assert _joined_midway(hf_target, None, prompts, [GREEDY] * len(prompts)) == plain
