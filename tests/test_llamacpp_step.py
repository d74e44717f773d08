"""The compiled greedy iteration on llama.cpp (`verispec.llamacpp.step`, llamacpp/llama_step.c).

The engine's Python path (`greedy_continuation`, `forward_argmax`, `verify_greedy`, both
rollbacks) is the reference: with the built-in pair on llama.cpp the compiled step must commit
the same tokens and record the same acceptance, position by position, at every draft length,
with a confidence stop, with k = 0 steps between drafting ones (pending tokens pile up), with a
prompt longer than one llama.cpp batch, and with rows that stop at different steps. Where it
cannot be built (no compiler) or is switched off, the Python path runs and says why. At T > 0
(the rule itself: test_compiled_rule.py; exactness: test_exactness.py) a row's tokens depend only
on its own stream, and at llama.cpp's default truncation the step feeds the draft's proposal
temperature the acceptance of every tau at the positions it verified.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from verispec.config import SamplingParams
from verispec.drafters.model import ModelDrafter
from verispec.engine import generate_all
from verispec.llamacpp import GGUFTokenizer, LlamaCppModel
from verispec.llamacpp import compiled as llamacpp_compiled
from verispec.llamacpp import step as llamacpp_step
from verispec.models.gguf_convert import cached_gguf
from verispec.pair import DRAFT_DIR, TARGET_DIR
from verispec.proposal import TAUS
from verispec.sampling import RowSampling
from verispec.stats import SpecStats

PROMPTS = ["def quicksort(arr):\n", "class Stack:\n    def __init__(self):", "import os\n\ndef walk(path):"]


@pytest.fixture(scope="module")
def pair():
    target, draft = LlamaCppModel(cached_gguf(TARGET_DIR, "f32")), LlamaCppModel(cached_gguf(DRAFT_DIR, "f32"))
    return target, draft, [GGUFTokenizer(target).encode(text).ids for text in PROMPTS]


class Cycle:
    """A draft-length policy that cycles through fixed lengths (0 included): not FixedLength, so
    the draft's prefill is deferred to its first proposal, as with --k auto."""

    def __init__(self, lengths: tuple[int, ...]):
        self.lengths, self.k_max, self.calls = lengths, max(lengths), 0

    def choose(self, batch: int = 1) -> int:
        self.calls += 1
        return self.lengths[(self.calls - 1) % len(self.lengths)]

    def observe(self, *args, **kwargs) -> None:
        pass


def _run(target, draft, prompts, params, k, threshold=0.0, python=False):
    """(tokens per row, stats) of speculative decoding; python=True: the engine's Python path."""
    stats = SpecStats()
    if python:
        target.compiled_step = lambda *args: None  # the instance offers no compiled iteration
    try:
        tokens = generate_all(
            target, prompts, params, ModelDrafter(draft, threshold) if draft is not None else None, k, stats
        )
    finally:
        vars(target).pop("compiled_step", None)
    return tokens, stats


def _acceptance(stats: SpecStats) -> list:
    return [
        (
            r.target_passes,
            r.proposed,
            r.accepted,
            r.verified_by_position,
            r.accepted_by_position,
            r.beta_sum_by_position,
        )
        for r in stats.requests
    ]


def test_the_compiled_step_is_built_and_used_here():
    assert llamacpp_step.step_status().startswith("compiled step loaded")  # CI has a compiler and llama.h


@pytest.mark.parametrize(
    "rows, k, threshold", [(1, 1, 0.0), (1, 4, 0.0), (1, 6, 0.0), (1, 4, 0.5), (3, 3, 0.0), (3, 4, 0.5)]
)
def test_the_compiled_step_commits_what_the_python_path_commits(pair, rows, k, threshold):
    target, draft, prompts = pair
    params = SamplingParams(temperature=0, max_new_tokens=40)
    compiled, compiled_stats = _run(target, draft, prompts[:rows], params, k, threshold)
    python, python_stats = _run(target, draft, prompts[:rows], params, k, threshold, python=True)
    assert compiled == python
    assert _acceptance(compiled_stats) == _acceptance(python_stats)
    assert (
        compiled_stats.proposed > 0 and 0 < compiled_stats.accepted < compiled_stats.proposed
    )  # a real test: both outcomes occur


def test_plain_decoding_through_the_compiled_step_commits_what_the_python_path_commits(pair):
    target, draft, prompts = pair
    params = SamplingParams(temperature=0, max_new_tokens=40)
    steps = []
    target.compiled_step = lambda *args: steps.append(llamacpp_step.CompiledStep.maybe(target, *args)) or steps[-1]
    try:
        compiled = generate_all(target, prompts, params)
    finally:
        del target.compiled_step
    python, _ = _run(target, None, prompts, params, 0, python=True)
    assert steps and steps[0] is not None and steps[0].draft is None
    assert compiled == python


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
def test_a_lookup_runs_on_the_compiled_step_and_commits_plain_decodings_tokens(pair, lookup):
    """Prompt lookup and suffix drafting propose before each compiled call (q one-hot): greedy, the
    Python path's tokens and acceptance; sampled, plain decoding's tokens for the same seeds (the
    coupled form: the target's own draws), with k = 0 steps between. Not vacuous: proposals are
    made and both kept and rejected; a row whose seed differs commits other tokens."""
    from verispec.drafters.ngram import PromptLookupDrafter
    from verispec.drafters.suffix import SuffixDrafter

    target, _, prompts = pair
    repeated = [p + p[1:] for p in prompts]  # prompts that repeat: the lookups find matches
    make = PromptLookupDrafter if lookup == "ngram" else SuffixDrafter
    steps = []
    target.compiled_step = lambda *args: steps.append(llamacpp_step.CompiledStep.maybe(target, *args)) or steps[-1]
    try:
        greedy = SamplingParams(temperature=0, max_new_tokens=40)
        compiled_stats = SpecStats()
        compiled = generate_all(target, repeated, greedy, make(), Cycle((4, 0, 8)), compiled_stats)
        sampled = [SamplingParams(temperature=t, top_k=40, max_new_tokens=40, seed=s) for t, s in ((1.0, 3), (0.7, 4))]
        sampled += [replace(sampled[0], seed=5)]
        sampled_stats = SpecStats()
        spec = generate_all(target, repeated, sampled, make(), Cycle((4, 0, 8)), sampled_stats)
        plain = generate_all(target, repeated, sampled)
        other = generate_all(target, repeated, [replace(p, seed=p.seed + 1) for p in sampled])
    finally:
        del target.compiled_step
    assert steps and all(step is not None and step.lookup for step in steps[:2])
    python_stats = SpecStats()
    target.compiled_step = lambda *args: None  # the Python path
    try:
        assert generate_all(target, repeated, greedy, make(), Cycle((4, 0, 8)), python_stats) == compiled
    finally:
        del target.compiled_step
    assert _acceptance(compiled_stats) == _acceptance(python_stats)
    assert 0 < compiled_stats.accepted < compiled_stats.proposed
    assert spec == plain and 0 < sampled_stats.accepted < sampled_stats.proposed
    assert other != plain


@pytest.mark.parametrize("threshold", [0.0, 0.6])
def test_a_combined_draft_runs_on_the_compiled_step_and_commits_the_python_paths_tokens(pair, threshold):
    """Suffix drafting and the draft model as one: per call the rows the combined draft names verify the lookup's
    tokens and the draft proposes for the others; a call where every row takes the lookup's runs no draft (its
    pending tokens pile up). Greedy: the Python path's tokens and acceptance, in a batch of one (passes by lookup
    alone and by the model) and of three (mixed passes), with k = 0 steps between; with a confidence threshold the
    draft stops where every row it proposes for is below it (rows taking the lookup's tokens do not count)."""
    from verispec.drafters.combined import CombinedDrafter
    from verispec.drafters.suffix import SuffixDrafter

    target, draft, prompts = pair
    batches = [[prompts[0] * 3], [prompts[0] * 3, prompts[1], prompts[2] + prompts[2]]]
    greedy = SamplingParams(temperature=0, max_new_tokens=60)
    for batch in batches:
        runs = []
        for python in (False, True):
            steps, stats, drafter = [], SpecStats(), CombinedDrafter(SuffixDrafter(), ModelDrafter(draft, threshold))
            maybe = (lambda *args: None) if python else llamacpp_step.CompiledStep.maybe
            target.compiled_step = lambda *args: steps.append(maybe(target, *args)) or steps[-1]
            try:
                tokens = generate_all(target, batch, greedy, drafter, Cycle((4, 0, 8)), stats)
            finally:
                del target.compiled_step
            runs.append((tokens, _acceptance(stats), drafter.lookup_passes, drafter.mixed_passes))
            assert python or (steps[0] is not None and steps[0].combined)
        assert runs[0] == runs[1]
        (tokens, _, alone, mixed) = runs[0]
        assert tokens == generate_all(target, batch, greedy)
        assert alone > 0 if len(batch) == 1 else mixed > 0


def test_k_0_steps_and_a_prompt_longer_than_one_llama_cpp_batch(pair):
    target, draft, prompts = pair
    long_prompt = (prompts[0] + prompts[1] + prompts[2]) * 40  # > 512 tokens, all pending at the draft's first proposal
    assert len(long_prompt) > 512
    params = SamplingParams(temperature=0, max_new_tokens=30)
    for policy in ((0, 0, 3, 1), (2, 0, 0, 0, 4)):
        compiled, compiled_stats = _run(target, draft, [long_prompt, prompts[1]], params, Cycle(policy))
        python, python_stats = _run(target, draft, [long_prompt, prompts[1]], params, Cycle(policy), python=True)
        assert compiled == python and _acceptance(compiled_stats) == _acceptance(python_stats)


def test_rows_that_stop_at_different_steps_give_each_row_its_own_greedy_tokens(pair):
    target, draft, prompts = pair
    newline = GGUFTokenizer(target).encode("\n").ids[0]
    params = SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=(newline,))
    alone = [generate_all(target, [prompt], params)[0] for prompt in prompts]
    assert len({len(tokens) for tokens in alone}) > 1  # the rows do stop at different steps
    assert _run(target, draft, prompts, params, 4)[0] == alone
    # with a confidence stop, rows that are done no longer count on either path
    compiled, compiled_stats = _run(target, draft, prompts, params, 4, threshold=0.5)
    python, python_stats = _run(target, draft, prompts, params, 4, threshold=0.5, python=True)
    assert compiled == python and _acceptance(compiled_stats) == _acceptance(python_stats)


def _fresh_load(monkeypatch, tmp_path):
    monkeypatch.setattr(llamacpp_compiled, "_status", "not loaded")
    monkeypatch.setattr(llamacpp_compiled, "_library", None)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))


def test_the_step_compiles_into_the_cache_directory_and_says_so(monkeypatch, tmp_path, capsys, pair):
    _fresh_load(monkeypatch, tmp_path)
    assert llamacpp_step.step_status().startswith("compiled step loaded")
    assert list(tmp_path.glob("kernels/llama_step-*/llama_step.so"))
    assert "verispec: building the compiled step into" in capsys.readouterr().err  # a first run's wait, said
    _fresh_load(monkeypatch, tmp_path)
    assert llamacpp_step.step_status().startswith("compiled step loaded") and not capsys.readouterr().err  # built


@pytest.mark.parametrize("setting", ["no compiler", "switched off"])
def test_without_the_compiled_step_the_python_path_runs_and_says_why(monkeypatch, tmp_path, capsys, pair, setting):
    target, draft, prompts = pair
    _fresh_load(monkeypatch, tmp_path)
    if setting == "no compiler":
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        monkeypatch.setenv("PATH", str(tmp_path))
    else:
        monkeypatch.setenv("VERISPEC_LLAMA_STEP", "0")
    params = SamplingParams(temperature=0, max_new_tokens=20)
    drafter = ModelDrafter(draft)
    drafter.start(prompts[:1], 64)
    assert target.compiled_step(target.new_cache(1, 64), drafter, RowSampling(params, 1), prompts[:1], 4) is None
    status = llamacpp_step.step_status()
    assert (
        ("no C compiler" in status and "using the Python path" in capsys.readouterr().err)
        if setting == "no compiler"
        else "disabled" in status
    )
    assert _run(target, draft, prompts[:1], params, 4)[0] == generate_all(target, prompts[:1], params)


def test_at_a_temperature_each_row_draws_from_its_own_stream(pair, monkeypatch):
    """A seeded row's tokens through the compiled step do not depend on the other row (its prompt,
    seed, budget or settings: each row has its own in C; invariant mode alone runs the Python path)."""
    target, draft, prompts = pair
    used = []
    maybe = llamacpp_step.CompiledStep.maybe
    monkeypatch.setattr(
        llamacpp_step.CompiledStep, "maybe", classmethod(lambda cls, *args: used.append(maybe(*args)) or used[-1])
    )
    mine = SamplingParams(temperature=0.8, seed=21, max_new_tokens=30)
    runs = [
        generate_all(
            target, [prompts[0], other], [mine, replace(mine, seed=seed, max_new_tokens=budget)], ModelDrafter(draft), 4
        )[0]
        for other, seed, budget in [(prompts[1], 1, 30), (prompts[2], 2, 5), (prompts[1], 3, 12)]
    ]
    assert all(used) and runs[0] == runs[1] == runs[2]
    assert (
        generate_all(target, [prompts[0], prompts[1]], [replace(mine, seed=22), mine], ModelDrafter(draft), 4)[0]
        != runs[0]
    )
    used.clear()
    mixed = [mine, replace(mine, temperature=0.5, top_k=20)]
    assert generate_all(target, [prompts[0], prompts[1]], mixed, ModelDrafter(draft), 4)[0] == runs[0]
    assert all(used)
    used.clear()
    generate_all(target, prompts[:2], [mine, replace(mine, sampling="invariant")], ModelDrafter(draft), 4)
    assert used == [None]


def test_at_llama_cpp_default_truncation_the_step_runs_and_feeds_the_proposal_temperature(pair, monkeypatch):
    """At T = 1, top-k 40, top-p 0.95, min-p 0.05 the compiled step runs; with --draft-temperature auto
    (ModelDrafter's default) each call hands the draft's proposal temperature the grid at the verified
    positions of the active rows, in which the column of each row's tau is the beta the step reports
    (sum min(p, q') of what it drew from), and the choice leaves tau = 1 for some row."""
    target, draft, prompts = pair
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05, seed=3, max_new_tokens=80)
    steps, calls = [], []
    maybe, run = llamacpp_step.CompiledStep.maybe, llamacpp_step.CompiledStep.run
    monkeypatch.setattr(
        llamacpp_step.CompiledStep, "maybe", classmethod(lambda cls, *args: steps.append(maybe(*args)) or steps[-1])
    )

    def recorded(self, k, *args):
        taus, observed, observe = self.proposal.chosen().numpy(), [], self.proposal.observe
        self.proposal.observe = lambda grid, verified: observed.append((grid, verified)) or observe(grid, verified)
        try:
            result = run(self, k, *args)
        finally:
            del self.proposal.observe
        calls.append((taus, result[2], result[3], observed))
        return result

    monkeypatch.setattr(llamacpp_step.CompiledStep, "run", recorded)
    generate_all(target, prompts, params, ModelDrafter(draft), 4)
    assert steps and all(steps)
    grid_taus = np.asarray(TAUS, np.float32)
    checked = 0
    for taus, beta, made, observed in calls:
        assert len(observed) == (made > 0)
        for grid, verified in observed:
            for b, row in enumerate(beta):
                if verified[b].any():
                    column = int(np.argmin(abs(grid_taus - taus[b])))
                    assert int(verified[b].sum()) == len(row)
                    assert np.allclose(np.asarray(grid)[b, : len(row), column], row, atol=1e-5)
                    checked += 1
    assert checked > 10 and any((taus < 1).any() for taus, *_ in calls)


def test_plan_times_a_draft_on_the_compiled_step_it_runs_on(pair, monkeypatch):
    """`plan` predicts what `bench` measures: for a draft that llama.cpp's compiled step runs, its costs
    come from passes of that step at every k (`profile_passes`), not from the Python path's forward,
    process_logits and draw. The negative control: a target without the compiled step is timed on the
    Python path, and no compiled pass runs."""
    from verispec.analysis.plan import plan
    from verispec.analysis.profile import profile_passes

    target, draft, prompts = pair
    ks, run = [], llamacpp_step.CompiledStep.run
    monkeypatch.setattr(
        llamacpp_step.CompiledStep, "run", lambda self, k, *a, **kw: ks.append(k) or run(self, k, *a, **kw)
    )
    costs = profile_passes(target, ModelDrafter(draft), k_max=3, context_length=40, repeats=1)
    assert len(costs.target_s) == 4 and min(costs.target_s) > 0 and costs.draft_s > 0
    assert sorted(set(ks)) == [0, 1, 2, 3]
    params = SamplingParams(temperature=0, max_new_tokens=12)
    report = plan(target, {"draft": ModelDrafter(draft)}, prompts[:1], params, k_max=3)
    context = len(prompts[0]) + 12
    costs = profile_passes(target, ModelDrafter(draft), 3, context)
    assert report["candidates"][0]["c"] == costs.draft_s / costs.target_s[0]  # the cached costs, in its plain passes
    assert report["candidates"][0]["predicted_speedup"][0] == 1.0
    ks.clear()
    target.compiled_step = lambda *args: None  # the Python path
    try:
        python = profile_passes(target, ModelDrafter(draft), k_max=2, context_length=40, repeats=1)
    finally:
        vars(target).pop("compiled_step", None)
    assert ks == [] and len(python.target_s) == 3


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
def test_plan_times_a_lookup_at_every_k_on_the_path_it_runs(pair, monkeypatch, lookup):
    """A model-free drafter runs the compiled step on llama.cpp (its lookup before each call); `profile_passes`
    times it there at every k by having it propose its padded lookup at every pass: on calibrate's synthetic
    prompt the lookup itself finds nothing, and (the negative control) would time nothing but plain passes."""
    from verispec.analysis import profile
    from verispec.drafters.ngram import PromptLookupDrafter
    from verispec.drafters.suffix import SuffixDrafter

    target = pair[0]
    make = PromptLookupDrafter if lookup == "ngram" else SuffixDrafter
    ks, run = [], llamacpp_step.CompiledStep.run

    def recorded(self, k, *args, **kwargs):
        done = run(self, k, *args, **kwargs)
        ks.append(done[3])  # the proposals made (step.Iteration's k)
        return done

    monkeypatch.setattr(llamacpp_step.CompiledStep, "run", recorded)
    profile._PASSES.clear()
    costs = profile.profile_passes(target, make(), k_max=3, context_length=40, repeats=1)
    assert sorted(set(ks)) == [0, 1, 2, 3] and len(costs.target_s) == 4 and costs.draft_s is None
    assert min(costs.target_s) > 0
    ks.clear()
    monkeypatch.setattr(profile, "_EveryPass", lambda drafter: drafter)  # the lookup as it is
    profile._PASSES.clear()
    with pytest.raises(KeyError):  # no pass of 2 or more positions was timed
        profile.profile_passes(target, make(), k_max=3, context_length=40, repeats=1)
    assert sorted(set(ks)) != [0, 1, 2, 3]  # some k never ran


def test_plan_times_passes_at_its_sampling_settings(pair, monkeypatch):
    """At T > 0 a pass also processes the vocabulary at each position (temperature, top-k, ...) and runs the
    rule on it: `plan` times its passes at its own settings, so that at T = 1 its costs are T = 1's. The
    control: greedy timing (the default) runs no row at T > 0; each setting is profiled apart (not cached as one)."""
    from verispec import engine
    from verispec.analysis import profile
    from verispec.analysis.plan import plan

    target, draft, prompts = pair
    seen, join = [], engine.Batch.join  # the settings of every row that joins a calibration's batch

    def recorded(self, rows, params, ids, *args, **kwargs):
        seen.extend(p for p, i in zip(params, ids) if i[0] == "calibration")
        return join(self, rows, params, ids, *args, **kwargs)

    monkeypatch.setattr(engine.Batch, "join", recorded)
    sampled = SamplingParams(temperature=1.0, top_k=40, max_new_tokens=12, seed=3)
    profile._PASSES.clear()
    greedy_costs = profile.profile_passes(target, ModelDrafter(draft), k_max=2, context_length=40, repeats=1)
    assert seen and all(p.greedy for p in seen)
    seen.clear()
    sampled_costs = profile.profile_passes(target, ModelDrafter(draft), 2, 40, 1, sampling=sampled)
    assert seen and all(p.temperature == 1.0 and p.top_k == 40 and p.seed == 0 for p in seen)
    assert sampled_costs is not greedy_costs
    seen.clear()
    plan(target, {"draft": ModelDrafter(draft)}, prompts[:1], sampled, k_max=2)
    assert seen and all(p.temperature == 1.0 and p.top_k == 40 for p in seen)  # plain's and the draft's passes
