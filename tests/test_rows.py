"""Per-row sampling in a batch (sampling.RowSampling, streams.RowStreams): each row its own
settings, budget, stop tokens and random stream.

- RowStreams: row b's numbers are the outputs of a splitmix64 generator started at its key
  (the generator the compiled step runs per row), whatever the other rows draw and however
  the draws are split into calls; uniform on [0, 1) by chi-square at 1e-9, with a negative
  control (u squared) that fails.
- RowSampling: one seed for a batch gives row b the seed row_seed(seed, b); a list gives each
  row its own; each row is processed with its own settings.
- The engine: a seeded row gives the same tokens alone and in a batch of 16 rows with other
  prompts, seeds, settings and budgets, in both modes, with a draft model, prompt lookup and none;
  equal seeds and prompts give equal rows; each row stops at its own budget and stop tokens.
The joint distribution of a batch with mixed settings is tested in test_exactness.py.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from stats_helpers import assert_distributed_as, is_distributed_as

from verispec.config import SamplingParams
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.engine import generate_all
from verispec.sampling import RowSampling, process_logits, row_seed
from verispec.streams import RowStreams, splitmix64

pytestmark = pytest.mark.usefixtures("one_thread")

MASK = (1 << 64) - 1


def _reference_splitmix64(state: int, n: int) -> list[float]:
    """The textbook generator (state += gamma; mix), in Python integers: n numbers in [0, 1)."""
    out = []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        z ^= z >> 31
        out.append((z >> 11) * 2.0**-53)
    return out


def test_a_rows_stream_is_splitmix64_from_its_key_whatever_the_other_rows_draw():
    seeds = [0, 1, 2**63 - 1, 123456789]
    streams = RowStreams(seeds)
    keys = [int(k) & MASK for k in streams.keys.tolist()]
    assert keys[0] == int(splitmix64(torch.tensor([0])).item()) & MASK
    drawn = [[] for _ in seeds]
    for shape, rows in [((4, 3), None), ((2, 5), [1, 3]), ((1, 2, 2), [2]), ((4, 1), None)]:
        u = streams.uniform(shape) if rows is None else streams.select(rows).uniform(shape)
        for i, b in enumerate(rows or range(len(seeds))):
            drawn[b].extend(u[i].reshape(-1).tolist())
    for b, key in enumerate(keys):
        assert drawn[b] == _reference_splitmix64(key, len(drawn[b]))
    assert streams.counters.tolist() == [len(d) for d in drawn] == [4, 9, 8, 9]


def test_row_streams_are_uniform_and_the_negative_control_is_not():
    u = RowStreams(range(1000)).uniform((1000, 200)).reshape(-1).numpy()  # 200,000 numbers, 1000 rows
    bins = 100
    counts = np.bincount((u * bins).astype(int), minlength=bins)
    assert_distributed_as(counts, np.full(bins, 1 / bins), are_counts=True, label="RowStreams uniform")
    squared = np.bincount((u**2 * bins).astype(int), minlength=bins)
    assert not is_distributed_as(squared, np.full(bins, 1 / bins), are_counts=True)
    assert 0.0 <= u.min() and u.max() < 1.0


def test_row_seeds_from_one_seed_or_one_per_row():
    batch = RowSampling(SamplingParams(seed=11), 3)
    assert batch.seeds == [11, row_seed(11, 1), row_seed(11, 2)] and len(set(batch.seeds)) == 3
    own = RowSampling([SamplingParams(seed=5), SamplingParams(seed=5), SamplingParams()], 3)
    assert own.seeds[:2] == [5, 5]
    assert RowSampling(SamplingParams(), 2).seeds != RowSampling(SamplingParams(), 2).seeds  # fresh entropy
    with pytest.raises(ValueError, match="one per prompt"):
        RowSampling([SamplingParams()] * 2, 3)
    with pytest.raises(ValueError, match="one per prompt"):
        RowSampling([SamplingParams(), {"temperature": 1.0}], 2)


def test_each_row_is_processed_with_its_own_settings():
    settings = [
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.5),
        SamplingParams(temperature=0.7, top_k=3, seed=4),
        SamplingParams(min_p=0.2, sampling="invariant"),
    ]
    batch = RowSampling(settings, len(settings))
    assert batch.shared is None and len(batch.groups) == 4  # rows 0 and 3 share settings (seeds aside)
    assert (
        batch.rows("greedy") == [1] and batch.rows("invariant") == [4] and sorted(batch.rows("rejection")) == [0, 2, 3]
    )
    logits = torch.randn(5, 2, 9, generator=torch.Generator().manual_seed(0))
    expected = torch.stack([process_logits(logits[b], p) for b, p in enumerate(settings)])
    assert torch.equal(batch.process(logits), expected)
    assert RowSampling(SamplingParams(top_k=2, seed=1), 4).shared == SamplingParams(top_k=2, seed=1)


# --- the engine -----------------------------------------------------------------------------

PROMPT = [1, 2, 3, 1, 2]


def _drafter(kind, drafts):
    return {"model": lambda: ModelDrafter(drafts["close"]), "ngram": PromptLookupDrafter, "none": lambda: None}[kind]()


OTHER_SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0),
    dict(temperature=0.5, top_p=0.8),
    dict(temperature=1.2, top_k=3),
    dict(temperature=0.9, min_p=0.1),
    dict(temperature=0.7, sampling="invariant"),
]


def _companions(rows: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """rows other prompts (PROMPT's length: the same padded shapes) with other settings, seeds and budgets."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 5, (rows, len(PROMPT)), generator=generator).tolist()
    settings = [
        SamplingParams(
            **OTHER_SETTINGS[(b + seed) % len(OTHER_SETTINGS)],
            seed=None if b % 3 == 0 else 1000 * seed + b,
            max_new_tokens=5 + (7 * b + seed) % 30,
        )
        for b in range(rows)
    ]
    return prompts, settings


@pytest.mark.parametrize("kind", ["model", "ngram", "none"])
@pytest.mark.parametrize("mode", ["rejection", "invariant"])
def test_a_seeded_rows_tokens_are_the_same_alone_and_in_a_batch_of_16(markov, kind, mode):
    target, drafts = markov
    mine = SamplingParams(temperature=1.0, top_k=4, seed=42, max_new_tokens=24, sampling=mode)
    runs = [generate_all(target, [PROMPT], [mine], _drafter(kind, drafts), k=3)[0]]  # alone
    for seed, place in [(1, 0), (2, 7), (3, 15)]:
        prompts, settings = _companions(15, seed)
        prompts.insert(place, PROMPT)
        settings.insert(place, mine)
        runs.append(generate_all(target, prompts, settings, _drafter(kind, drafts), k=3)[place])
    assert all(run == runs[0] for run in runs), runs
    assert len(runs[0]) == 24
    # the control: another seed gives other tokens
    assert generate_all(target, [PROMPT], [replace(mine, seed=43)], _drafter(kind, drafts), k=3)[0] != runs[0]


def test_equal_seeds_and_prompts_give_equal_rows_and_one_seed_for_a_batch_does_not(markov):
    target, drafts = markov
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=20)
    same = generate_all(target, [PROMPT] * 4, [params] * 4, ModelDrafter(drafts["close"]), k=3)
    assert all(row == same[0] for row in same)
    batch = generate_all(target, [PROMPT] * 4, params, ModelDrafter(drafts["close"]), k=3)  # row b: row_seed(3, b)
    assert batch[0] == same[0] and len({tuple(row) for row in batch}) == 4


def test_each_row_stops_at_its_own_budget_and_stop_tokens(markov):
    target, drafts = markov
    greedy = generate_all(target, [PROMPT], SamplingParams(temperature=0, max_new_tokens=30))[0]
    stop = greedy[7]
    first_stop = greedy.index(stop)
    settings = [
        SamplingParams(temperature=0, max_new_tokens=30),
        SamplingParams(temperature=0, max_new_tokens=4),
        SamplingParams(temperature=0, max_new_tokens=30, stop_token_ids=(stop,)),
    ]
    rows = generate_all(target, [PROMPT] * 3, settings, ModelDrafter(drafts["close"]), k=4)
    assert rows == [greedy, greedy[:4], greedy[: first_stop + 1]]


def test_prompt_lookup_in_rejection_mode_commits_the_tokens_of_plain_sampling(markov):
    """Its q is one-hot, so the rule runs coupled (t ~ p, accepted while equal) and a row keeps one
    number per committed token: the tokens of plain sampling with the same seeds, whatever it
    proposed. A draft model's proposals are random, so there they differ (the control)."""
    target, drafts = markov
    prompts = [[b % 5, (b * 3) % 5, 1, 2, b % 5, (b * 3) % 5] for b in range(100)]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=9, max_new_tokens=16)
    plain = generate_all(target, prompts, params)
    assert generate_all(target, prompts, params, PromptLookupDrafter(), k=4) == plain
    assert (
        sum(a != b for a, b in zip(generate_all(target, prompts, params, ModelDrafter(drafts["close"]), k=4), plain))
        > 30
    )
