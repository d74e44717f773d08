"""The compiled step in a batch whose rows change (engine.Batch as the server drives it).

An empty `Batch` on a llama.cpp target with a llama.cpp draft (or none) runs the compiled step
(llamacpp/step.py, llama_step.c) while requests join (whole, or read piece by piece through
reserve / feed / join_staged), are cancelled and finish between steps, each row with its own
settings. Checked black-box, through the batch:
- greedy: each request's tokens equal the same schedule on the Python path and plain greedy
  decoding of its prompt alone (negative control: a joined row's pending token set wrong);
- a seeded row at T = 1 with llama.cpp's default truncation gives the same tokens alone and beside
  rows of other settings that join at other steps, in whatever row it lands, at a fixed k
  (negative control: a joined row's random stream keyed by its row index);
- rows of different settings (greedy; T = 1; T = 0.7 with top-k and min-p; T = 1.5 with top-p alone)
  in one batch are each distributed as the target under their own settings: the joint of three
  tokens, chi-square at a false-failure rate of 1e-9 (negative control: two settings swapped in C);
- log-probabilities on the compiled step equal the Python path's and the target's own;
- a plain compiled batch scores each row exactly as that row alone (a placeholder after every
  row's lone token; negative control: a batch without placeholders does not);
- a request in invariant mode cannot join a compiled batch (ValueError), and nothing changes;
- plain (k = 0) steps leave a joined prompt unread for the draft, as on the Python path, so that
  the engine times its reading at the first drafting step as prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from stats_helpers import assert_distributed_as, is_distributed_as
from test_exactness import PROMPT, TOKENS, VOCAB, _exact_joint, gguf, llama  # noqa: F401 (gguf: a fixture)
from test_llamacpp_step import PROMPTS, Cycle

from verispec.config import SamplingParams
from verispec.drafters.model import ModelDrafter
from verispec.engine import Batch, generate_all
from verispec.llamacpp import GGUFTokenizer, LlamaCppModel
from verispec.llamacpp.step import CompiledStep, step_status
from verispec.models.gguf_convert import cached_gguf
from verispec.pair import DRAFT_DIR, TARGET_DIR
from verispec.stats import SpecStats
from verispec.step import PythonStep

pytestmark = pytest.mark.skipif(not step_status().startswith("compiled step loaded"), reason="no compiled step here")

GREEDY = SamplingParams(temperature=0, max_new_tokens=40)
DEFAULTS = dict(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05)  # llama.cpp's default truncation


@pytest.fixture(scope="module")
def pair():
    """The built-in pair in f32 on llama.cpp, and PROMPTS and a long prompt as token ids. One thread
    each: llama.cpp's threads wait for each other spinning, which a shared machine turns into minutes."""
    target, draft = (LlamaCppModel(cached_gguf(d, "f32"), n_threads=1) for d in (TARGET_DIR, DRAFT_DIR))
    tokenizer = GGUFTokenizer(target)
    prompts = [tokenizer.encode(text).ids for text in PROMPTS]
    return target, draft, prompts + [tokenizer.encode("\n".join(PROMPTS) * 3).ids]


@pytest.fixture(scope="module")
def target():
    return llama(2, 11)  # test_exactness's target: the `gguf` fixture converts it


@dataclass
class Request:
    """One request of a schedule: it joins before step `at` (or starts being read there, `piece`
    tokens a step, through reserve / feed / join_staged) and is cancelled before step `cancel_at`."""

    id: str
    prompt: list[int]
    params: SamplingParams
    at: int = 0
    cancel_at: int | None = None
    piece: int | None = None
    logprobs: int | None = None


@dataclass
class Served:
    """What a schedule gave: per request, its tokens, log-probabilities and finish reason."""

    tokens: dict  # id -> its tokens
    logprobs: dict  # id -> its tokens' log-probabilities (where asked for)
    reasons: dict  # id -> finish reason
    stepper: object  # the batch's step
    stats: SpecStats


def _serve(model, draft, requests: list[Request], k, capacity: int, max_length: int, python: bool = False) -> Served:
    """Run a schedule through an empty Batch as the server does; python=True: the Python path."""
    if python:
        model.compiled_step = lambda *args: None  # the instance offers no compiled iteration
    try:
        batch = Batch(
            model,
            [],
            [],
            ModelDrafter(draft) if draft is not None else None,
            k,
            capacity=capacity,
            max_length=max_length,
        )
    finally:
        vars(model).pop("compiled_step", None)
    assert batch.can_change_rows
    tokens = {r.id: [] for r in requests}
    logprobs: dict = {r.id: [] for r in requests}
    reasons, staging = {}, {}  # id -> Staged
    last = max(max(r.at, r.cancel_at or 0) for r in requests)
    for step in range(1000):
        if step > last and not staging and not len(batch):
            break
        joining = [r for r in requests if r.at == step and r.piece is None]
        if joining:
            batch.join(
                [r.prompt for r in joining],
                [r.params for r in joining],
                [r.id for r in joining],
                [r.logprobs for r in joining],
            )
        for r in requests:
            if r.at == step and r.piece is not None:
                staging[r.id] = batch.reserve()
                assert staging[r.id] is not None, "this batch cannot stage a prompt"
        batch.cancel([r.id for r in requests if r.cancel_at == step])
        reasons.update({i: s.finish_reason for i, s in batch.finished})
        for r in [r for r in requests if r.id in staging]:
            staged, body = staging[r.id], r.prompt[:-1]
            if staged.fed < len(body):
                batch.feed(staged, body[staged.fed : staged.fed + r.piece])
            if staged.fed == len(body):
                batch.join_staged(staged, r.prompt, r.params, r.id, r.logprobs)
                del staging[r.id]
        if len(batch):
            for i, new in batch.step().items():
                tokens[i] += new
                logprobs[i] += batch.last_logprobs.get(i, [])
            reasons.update({i: s.finish_reason for i, s in batch.finished})
    else:
        raise AssertionError("the schedule did not end")
    batch.close()
    return Served(tokens, logprobs, reasons, batch.stepper, batch.stats)


def _greedy_schedule(prompts: list[list[int]]) -> list[Request]:
    """Capacity 3: a and b join first, c's long prompt is read in pieces from step 2, b is
    cancelled before step 6 and d takes its row."""
    return [
        Request("a", prompts[0], replace(GREEDY, max_new_tokens=40)),
        Request("b", prompts[1], replace(GREEDY, max_new_tokens=48), cancel_at=6),
        Request("c", prompts[3], replace(GREEDY, max_new_tokens=32), at=2, piece=24),
        Request("d", prompts[2], replace(GREEDY, max_new_tokens=30), at=7),
    ]


def _plain(model, prompt: list[int], params: SamplingParams) -> list[int]:
    return generate_all(model, [prompt], params)[0]


@pytest.fixture(scope="module")
def plain_greedy(pair) -> dict:
    """Each request of _greedy_schedule decoded alone, plainly (no drafter), to its budget."""
    model, _, prompts = pair
    return {r.id: _plain(model, r.prompt, r.params) for r in _greedy_schedule(prompts)}


def test_greedy_requests_joining_and_leaving_the_compiled_step_give_plain_greedy(pair, plain_greedy):
    model, draft, prompts = pair
    schedule = _greedy_schedule(prompts)
    compiled = _serve(model, draft, schedule, Cycle((0, 3, 1, 4)), capacity=3, max_length=160)
    python = _serve(model, draft, schedule, Cycle((0, 3, 1, 4)), capacity=3, max_length=160, python=True)
    assert isinstance(compiled.stepper, CompiledStep) and not isinstance(python.stepper, CompiledStep)
    assert compiled.tokens == python.tokens and compiled.reasons == python.reasons
    assert compiled.reasons == {"a": "length", "b": "abort", "c": "length", "d": "length"}
    assert 0 < compiled.stats.accepted < compiled.stats.proposed  # both outcomes of the rule occur
    assert 0 < len(compiled.tokens["b"]) < 48  # cancelled mid-way
    assert compiled.tokens == {i: plain[: len(compiled.tokens[i])] for i, plain in plain_greedy.items()}
    # plain decoding (no drafter) through the compiled step, rows changing
    plain = _serve(model, None, schedule, 0, capacity=3, max_length=160)
    assert isinstance(plain.stepper, CompiledStep) and plain.reasons == compiled.reasons
    assert plain.tokens == {i: tokens[: len(plain.tokens[i])] for i, tokens in plain_greedy.items()}


def test_negative_control_a_joined_row_whose_pending_token_is_wrong(pair, plain_greedy, monkeypatch):
    model, draft, prompts = pair
    add_rows = CompiledStep.add_rows
    monkeypatch.setattr(
        CompiledStep,
        "add_rows",
        lambda self, rows, pending: add_rows(self, rows, [(t + 1) % model.vocab_size for t in pending]),
    )
    wrong = _serve(model, draft, _greedy_schedule(prompts), Cycle((0, 3, 1, 4)), capacity=3, max_length=160)
    assert isinstance(wrong.stepper, CompiledStep)
    assert all(wrong.tokens[i] != plain[: len(wrong.tokens[i])] for i, plain in plain_greedy.items())


SEEDED = SamplingParams(**DEFAULTS, seed=1234, max_new_tokens=40)


def _beside(prompts: list[list[int]], seeded: SamplingParams) -> list[list[Request]]:
    """Two schedules in which the seeded request runs beside others of other settings: a greedy
    one, one at T = 0.7 with top-p 0.9 and no top-k, an unseeded one; it joins in row 2 at step
    3, or in row 1 at step 1 and moves to row 0 when the row before it finishes."""
    greedy = replace(GREEDY, max_new_tokens=30)
    nucleus = SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_new_tokens=44)
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=12)
    return [
        [
            Request("greedy", prompts[1], greedy),
            Request("nucleus", prompts[2], nucleus),
            Request("seeded", prompts[0], seeded, at=3),
            Request("unseeded", prompts[1], unseeded, at=5),
        ],
        [
            Request("unseeded", prompts[2], unseeded),
            Request("seeded", prompts[0], seeded, at=1),
            Request("nucleus", prompts[2], nucleus, at=2),
            Request("greedy", prompts[1], greedy, at=4),
        ],
    ]


def test_a_seeded_row_gives_the_same_tokens_alone_and_beside_rows_of_other_settings(pair):
    model, draft, prompts = pair
    alone = _serve(model, draft, [Request("seeded", prompts[0], SEEDED)], 3, capacity=4, max_length=64)
    assert isinstance(alone.stepper, CompiledStep)
    assert generate_all(model, [prompts[0]], SEEDED, ModelDrafter(draft), 3)[0] == alone.tokens["seeded"]
    first, second = (_serve(model, draft, s, 3, capacity=4, max_length=64) for s in _beside(prompts, SEEDED))
    assert isinstance(first.stepper, CompiledStep) and isinstance(second.stepper, CompiledStep)
    assert first.tokens["seeded"] == second.tokens["seeded"] == alone.tokens["seeded"]
    assert first.tokens["nucleus"] == second.tokens["nucleus"]  # seeded too, in other rows at other steps
    assert (
        first.tokens["greedy"]
        == second.tokens["greedy"]
        == _plain(model, prompts[1], replace(GREEDY, max_new_tokens=30))
    )
    assert len(alone.tokens["seeded"]) == 40
    other_seed = _serve(model, draft, [Request("seeded", prompts[0], replace(SEEDED, seed=1235))], 3, 4, 64)
    assert other_seed.tokens["seeded"] != alone.tokens["seeded"]  # the row really is sampled


def test_negative_control_a_random_stream_keyed_by_the_row_index(pair, monkeypatch):
    model, draft, prompts = pair
    add_rows = CompiledStep.add_rows

    def keyed_by_row(self, rows, pending):
        add_rows(self, rows, pending)
        for row in rows:
            self.rng[self.cache.seqs[row]] ^= np.uint64(row)  # row 0 keeps its stream

    monkeypatch.setattr(CompiledStep, "add_rows", keyed_by_row)
    alone = _serve(model, draft, [Request("seeded", prompts[0], SEEDED)], 3, capacity=4, max_length=64)
    first = _serve(model, draft, _beside(prompts, SEEDED)[0], 3, capacity=4, max_length=64)
    assert first.tokens["seeded"] != alone.tokens["seeded"]


# Rows of four settings, cycled row by row, in one compiled batch of the toy target and draft
# (test_exactness's, V = 5): each setting's rows are distributed as the target under it.
MIXED = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=3, min_p=0.05),
    dict(temperature=1.5, top_p=0.95),  # top-p without top-k
]
MIXED_CHUNK = 240  # rows per batch (llama.cpp runs at most 256 sequences): 60 of each setting


def _mixed_counts(model, draft, n: int, seed: int) -> tuple[list[np.ndarray], SpecStats]:
    """Counts [V**3] per setting of MIXED over n rows (n / 4 each), in batches of MIXED_CHUNK rows;
    half of each batch joins at its first step, half at its second."""
    counts, stats = [np.zeros(VOCAB**TOKENS, dtype=np.int64) for _ in MIXED], SpecStats()
    for chunk, start in enumerate(range(0, n, MIXED_CHUNK)):
        rows = min(MIXED_CHUNK, n - start)
        requests = [
            Request(
                str(b),
                PROMPT,
                SamplingParams(**MIXED[b % len(MIXED)], seed=seed * 100_000 + start + b, max_new_tokens=TOKENS),
                at=int(b >= rows // 2),
            )
            for b in range(rows)
        ]
        served = _serve(model, draft, requests, 3, capacity=MIXED_CHUNK, max_length=len(PROMPT) + TOKENS + 4)
        assert isinstance(served.stepper, CompiledStep), "the compiled step did not run"
        stats.proposed, stats.accepted = stats.proposed + served.stats.proposed, stats.accepted + served.stats.accepted
        for b in range(rows):
            cell = np.ravel_multi_index(served.tokens[str(b)], (VOCAB,) * TOKENS)
            counts[b % len(MIXED)][cell] += 1
    return counts, stats


@pytest.fixture(scope="module")
def exact_mixed(gguf):  # noqa: F811 (gguf: the fixture)
    return [_exact_joint(gguf["target"], SamplingParams(**setting)) for setting in MIXED]


def test_rows_of_different_settings_in_one_compiled_batch_are_each_exact(gguf, exact_mixed):  # noqa: F811
    counts, stats = _mixed_counts(gguf["target"], gguf["draft"], 4 * 6_000, seed=31)
    assert 0 < stats.accepted < stats.proposed  # both branches of the rule ran
    for setting, observed, exact in zip(MIXED, counts, exact_mixed):
        assert_distributed_as(observed, exact, are_counts=True, label=f"compiled batch, rows at {setting}")
    # the settings are far apart (total variation), so that a row run at another's would be seen
    assert all(0.5 * np.abs(a - b).sum() > 0.15 for i, a in enumerate(exact_mixed) for b in exact_mixed[i + 1 :])


def test_negative_control_two_settings_swapped_in_the_compiled_step(gguf, exact_mixed, monkeypatch):  # noqa: F811
    from verispec.llamacpp.compiled import sampling_struct

    add_rows = CompiledStep.add_rows
    swap = {1: MIXED[2], 2: MIXED[1]}  # T = 1 rows run at T = 0.7 top-k 3 min-p 0.05, and back

    def swapped(self, rows, pending):
        add_rows(self, rows, pending)
        for row in rows:
            setting = next(
                (s for i, s in swap.items() if self.sampling.params[row].temperature == MIXED[i]["temperature"]), None
            )
            if setting is not None:
                self.settings[self.cache.seqs[row]] = sampling_struct(SamplingParams(**setting))

    monkeypatch.setattr(CompiledStep, "add_rows", swapped)
    counts, _ = _mixed_counts(gguf["target"], gguf["draft"], 4 * 2_000, seed=32)
    assert not is_distributed_as(counts[1], exact_mixed[1], are_counts=True)
    assert not is_distributed_as(counts[2], exact_mixed[2], are_counts=True)
    assert is_distributed_as(counts[3], exact_mixed[3], are_counts=True)  # the others are right


def test_logprobs_on_the_compiled_step_equal_the_python_paths(pair):
    model, draft, prompts = pair
    schedule = [
        Request("other", prompts[1], replace(GREEDY, max_new_tokens=20)),
        Request("with", prompts[0], replace(GREEDY, max_new_tokens=30), at=2, logprobs=2),
        Request("sampled", prompts[2], SamplingParams(**DEFAULTS, seed=9, max_new_tokens=24), at=3, logprobs=3),
    ]
    compiled = _serve(model, draft, schedule, Cycle((0, 3, 1, 4)), capacity=3, max_length=64)
    python = _serve(model, draft, schedule[:2], Cycle((0, 3, 1, 4)), capacity=3, max_length=64, python=True)
    assert isinstance(compiled.stepper, CompiledStep)
    assert compiled.tokens["with"] == python.tokens["with"] and compiled.logprobs["other"] == []
    assert len(compiled.logprobs["with"]) == len(python.logprobs["with"]) == 30
    assert len(compiled.logprobs["sampled"]) == 24
    for (chosen, top), (chosen_py, top_py) in zip(compiled.logprobs["with"], python.logprobs["with"]):
        assert chosen == pytest.approx(chosen_py, abs=1e-4) and chosen == pytest.approx(max(top.values()), abs=1e-6)
        assert top.keys() == top_py.keys() and all(top[t] == pytest.approx(top_py[t], abs=1e-4) for t in top)
    # a sampled row's (other tokens than the Python path's): the target's own log-probabilities
    tokens = compiled.tokens["sampled"]
    with torch.no_grad():
        logits = model(torch.tensor([prompts[2] + tokens]))[0, len(prompts[2]) - 1 : -1]  # [24, V]
    reference = torch.log_softmax(logits.float(), dim=-1)
    for j, (token, (chosen, top)) in enumerate(zip(tokens, compiled.logprobs["sampled"])):
        assert chosen == pytest.approx(float(reference[j, token]), abs=1e-4)
        best = reference[j].topk(3)
        assert top.keys() == set(best.indices.tolist())
        assert all(top[t] == pytest.approx(float(v), abs=1e-4) for t, v in zip(best.indices.tolist(), best.values))


def _plain_logprobs(model, prompts: list[list[int]], together: bool) -> list[list]:
    """Each prompt's greedy log-probabilities from plain compiled steps: in one batch, or alone."""
    params = replace(GREEDY, max_new_tokens=12)
    requests = [Request(str(i), p, params, logprobs=1) for i, p in enumerate(prompts)]
    if together:
        served = _serve(model, None, requests, 0, capacity=len(prompts), max_length=160)
        assert isinstance(served.stepper, CompiledStep)
        return [served.logprobs[r.id] for r in requests]
    return [_serve(model, None, [r], 0, capacity=1, max_length=160).logprobs[r.id] for r in requests]


def test_a_plain_compiled_batch_scores_each_row_exactly_as_alone(pair):
    """Rows of one token each would run attention's one-query kernel, which differs from the one
    a verification pass takes: each gets a placeholder, and its log-probabilities are bit-equal."""
    model, _, prompts = pair
    assert _plain_logprobs(model, prompts[:3], together=True) == _plain_logprobs(model, prompts[:3], together=False)


def test_negative_control_a_plain_compiled_batch_without_placeholders(pair):
    model, _, prompts = pair
    bare = LlamaCppModel(model.path, n_threads=1)
    bare.shape_invariant = False  # no placeholders in its contexts
    assert _plain_logprobs(bare, prompts[:3], together=True) != _plain_logprobs(model, prompts[:3], together=False)


def test_an_invariant_request_cannot_join_a_compiled_batch_and_nothing_changes(pair):
    model, draft, prompts = pair
    batch = Batch(model, [], [], ModelDrafter(draft), 3, capacity=3, max_length=64)
    assert isinstance(batch.stepper, CompiledStep)
    params = replace(GREEDY, max_new_tokens=30)
    batch.join([prompts[0]], [params], ["a"])
    tokens = batch.step()["a"]
    invariant = SamplingParams(temperature=1.0, seed=3, max_new_tokens=20, sampling="invariant")
    with pytest.raises(ValueError, match="invariant"):
        batch.join([prompts[1], prompts[2]], [params, invariant], ["b", "c"])
    staged = batch.reserve()
    batch.feed(staged, prompts[2][:-1])
    with pytest.raises(ValueError, match="invariant"):
        batch.join_staged(staged, prompts[2], invariant, "c")
    batch.release(staged)
    assert batch.ids == ["a"] and len(batch.cache.host_lengths) == 1 and len(batch.sampling) == 1
    batch.join([prompts[1]], [params], ["b"])  # both free rows are free again
    staged = batch.reserve()
    batch.feed(staged, prompts[2][:-1])
    batch.join_staged(staged, prompts[2], params, "c")
    out = {"a": tokens, "b": [], "c": []}
    while len(batch):
        for i, new in batch.step().items():
            out[i] += new
    assert out == {i: _plain(model, p, params) for i, p in zip("abc", prompts)}


def test_a_draft_reads_joined_prompts_at_the_first_drafting_step_as_on_the_python_path(pair):
    """Plain (k = 0) steps leave a joined prompt unread on both paths; the engine times its reading
    at the first drafting step as a cost per request (prefill), which the policy keeps apart."""
    model, draft, prompts = pair
    seen = {}
    for python in (False, True):
        if python:
            model.compiled_step = lambda *args: None
        try:
            batch = Batch(model, [], [], ModelDrafter(draft), Cycle((0, 0, 3)), capacity=2, max_length=64)
        finally:
            vars(model).pop("compiled_step", None)
        batch.join([prompts[1]], [GREEDY], ["a"])
        seen[python] = []  # per step: (the joined prompt still unread, the step's prefill time grew)
        for _ in range(3):
            prefill = batch.stats.prefill_time_s
            batch.step()
            unread = batch.stepper.joined_unread  # the compiled step also counts the tokens decoded meanwhile
            seen[python].append((unread >= len(prompts[1]) - 1, batch.stats.prefill_time_s > prefill))
    assert isinstance(batch.stepper, PythonStep)
    assert seen[False] == seen[True] == [(True, False), (True, False), (False, True)]
