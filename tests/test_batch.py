"""Continuous batching (engine.Batch): rows join and leave between passes, exactly.

- Exactness under churn: requests for PROMPT join a batch of other requests (other prompts,
  settings and budgets) in free rows at random passes; some requests are cancelled at random
  (independently of their tokens); the completed PROMPT requests' 3-token continuations must
  match the exact joint distribution (chi-square at 1e-9, stats_helpers.py). Negative control:
  a join that forgets the new row's pending token (it keeps the previous occupant's) fails.
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
PLACEHOLDER = SamplingParams(temperature=0, max_new_tokens=1)
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
    settings = rng.choice([dict(temperature=0), dict(temperature=1.3), dict(temperature=0.6, top_p=0.8), dict(temperature=1.0, sampling="invariant")])
    return rng.choice(OTHER_PROMPTS), SamplingParams(**settings, max_new_tokens=rng.randint(2, 9), seed=rng.randrange(2**40))


def churn(model, drafter, n: int, seed: int, batch_cls=Batch, k: int = 3) -> np.ndarray:
    """Counts [V**3] of the 3-token continuations of n completed PROMPT requests, run through
    one Batch of SLOTS rows with joins at random passes, background requests and cancels."""
    rng = random.Random(seed)
    batch = batch_cls(model, [[0]] * SLOTS, PLACEHOLDER, drafter, k=k, live=[False] * SLOTS, compiled=False, max_length=32)
    kinds: list[str | None] = [None] * SLOTS  # "probe" (a PROMPT request), "other", or None (free)
    outputs: list[list[int]] = [[] for _ in range(SLOTS)]
    counts = np.zeros(VOCAB**TOKENS, dtype=np.int64)
    started = done = 0
    while done < n:
        free = [row for row in range(SLOTS) if not batch.active[row]]
        for row in free:
            if kinds[row] == "probe" and batch.requests[row].finish_reason == "length":
                counts[np.ravel_multi_index(outputs[row], (VOCAB,) * TOKENS)] += 1
                done += 1
            kinds[row] = None
        joining = [row for row in free if rng.random() < 0.7]  # not every free row at every pass
        rows, prompts, params = [], [], []
        for row in joining:
            if rng.random() < 0.75 and started < n + n // 8:
                prompt, p = PROMPT, SamplingParams(**SETTING, max_new_tokens=TOKENS, seed=rng.randrange(2**40))
                kinds[row], started = "probe", started + 1
            else:
                (prompt, p), kinds[row] = _other(rng), "other"
            rows.append(row), prompts.append(prompt), params.append(p)
            outputs[row] = []
        if rows:
            batch.join(rows, prompts, params)
        running = [row for row in range(SLOTS) if batch.active[row]]
        cancelled = [row for row in running if rng.random() < 0.01]  # chosen without looking at the tokens
        batch.cancel(cancelled)
        if not any(batch.active):
            if started >= n + n // 8 and not any(kinds[r] == "probe" for r in range(SLOTS)):
                started = 0  # every probe was cancelled or done: start more
            continue
        for row, tokens in enumerate(batch.step()):
            outputs[row].extend(tokens)
    return counts


class ForgetsThePendingToken(Batch):
    """A planted churn bug: a joining row keeps its previous occupant's pending token."""

    def join(self, rows, prompts, params):
        old = list(self.pending_ids)
        super().join(rows, prompts, params)
        self.pending_ids = [old[r] if r in rows and old[r] != 0 else p for r, p in enumerate(self.pending_ids)]
        self.pending = torch.tensor(self.pending_ids)


@pytest.mark.parametrize("name", ["model", "ngram", "early-exit"])
def test_joint_distribution_is_exact_under_churn(target, made, exact, name):
    counts = churn(target, DRAFTERS[name](target, made), 20_000, seed=700 + ["model", "ngram", "early-exit"].index(name))
    assert_distributed_as(counts, exact, are_counts=True, label=f"churn {name} {SETTING} k=3")


def test_negative_control_a_join_that_keeps_the_old_pending_token(target, made, exact):
    counts = churn(target, DRAFTERS["model"](target, made), 6_000, seed=790, batch_cls=ForgetsThePendingToken)
    assert not is_distributed_as(counts, exact, are_counts=True)


GREEDY = SamplingParams(temperature=0, max_new_tokens=12)


def _joined_midway(model, drafter, prompts, params, k=3) -> list[list[int]]:
    """prompts[i] with params[i] joined one by one into a batch already running other requests;
    returns each one's tokens."""
    rng = random.Random(5)
    slots = len(prompts) + 3
    batch = Batch(model, [[0]] * slots, PLACEHOLDER, drafter, k=k, live=[False] * slots, compiled=False, max_length=64)
    outputs = {}
    waiting = list(range(len(prompts)))
    where: dict[int, int] = {}
    background = [(r, *_other(rng)) for r in range(len(prompts), slots)]
    batch.join([r for r, _, _ in background], [p for _, p, _ in background], [replace(q, max_new_tokens=40) for _, _, q in background])
    while waiting or any(batch.active[r] for r in where):
        if waiting and rng.random() < 0.5:
            i = waiting.pop(0)
            where[i] = i
            batch.join([i], [prompts[i]], [params[i]])
            outputs[i] = []
        if not any(batch.active):
            continue
        for row, tokens in enumerate(batch.step()):
            if row in outputs:
                outputs[row].extend(tokens)
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


@pytest.mark.parametrize("name", ["model", "ngram"])
def test_a_seeded_row_gives_the_same_tokens_alone_and_joined_into_a_busy_batch(target, made, name):
    params = [SamplingParams(temperature=1.0, top_k=4, max_new_tokens=20, seed=1000 + i) for i in range(4)]
    prompts = [PROMPT, [1, 2, 3], PROMPT, [4]]
    alone = [generate_all(target, [p], q, DRAFTERS[name](target, made), k=3)[0] for p, q in zip(prompts, params)]
    assert _joined_midway(target, DRAFTERS[name](target, made), prompts, params) == alone
    assert len({tuple(a) for a in alone}) == 4  # the rows really are sampled


def test_bad_joins_are_clear_errors(target, made):
    batch = Batch(target, [[0]] * 2, PLACEHOLDER, DRAFTERS["model"](target, made), k=2, live=[True, False], compiled=False, max_length=32)
    with pytest.raises(ValueError, match="row 0 is not a free row"):
        batch.join([0], [PROMPT], [GREEDY])
    with pytest.raises(ValueError, match="row 5 is not a free row"):
        batch.join([5], [PROMPT], [GREEDY])
    with pytest.raises(ValueError, match="exceeds the batch's max_length"):
        batch.join([1], [PROMPT], [replace(GREEDY, max_new_tokens=40)])
    with pytest.raises(ValueError, match="prompts\\[0\\] is empty"):
        batch.join([1], [[]], [GREEDY])
    assert batch.active == [True, False]  # nothing changed
    batch.join([1], [PROMPT], [GREEDY])
    assert batch.active == [True, True]
