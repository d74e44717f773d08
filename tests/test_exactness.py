"""One exactness suite, run over every drafter verispec has.

The target is a small random verispec Llama (V = 5, peaked logits). Each drafter must
- make the joint distribution of a 3-token continuation (125 cells, enumerated exactly under
  the processed target) match a batch of N speculative samples: Pearson chi-square at a
  false-failure rate of 1e-9 (stats_helpers.py), with both acceptances and rejections seen;
- give greedy output equal, token for token, to plain greedy decoding (float32), on a ragged
  batch, at k = 1 and k = 4.
Negative controls: a drafter that declares a q other than the one it drew from, and a target
sampled at the wrong temperature, both fail the same chi-square test.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
from stats_helpers import assert_distributed_as, is_distributed_as

from verispec.config import SamplingParams
from verispec.drafters.combined import CombinedDrafter
from verispec.drafters.early_exit import EarlyExitDrafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.drafters.suffix import SuffixDrafter
from verispec.engine import generate_all
from verispec.models.llama import LlamaConfig, LlamaForCausalLM, init_weights
from verispec.models.quantize import quantize_model
from verispec.policy import AdaptiveLength
from verispec.sampling import process_logits, row_seed
from verispec.stats import SpecStats

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py

VOCAB = 5
PROMPT = [2, 4, 1, 2, 4]  # "2 4" recurs, so prompt lookup proposes from the first step
TOKENS = 3
N = 30_000
SETTING = dict(temperature=0.8, top_k=4)  # a processed target: temperature and truncation
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)
GREEDY_PROMPTS = [[1, 2, 3], [4], [0, 4, 4, 2, 1, 3]]


def llama(layers: int, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return init_weights(LlamaForCausalLM(config), std=0.5, seed=seed).eval()


def _gpt2_draft():
    transformers = pytest.importorskip("transformers")
    from verispec.models.hf import HFCausalLM

    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=64,
        initializer_range=0.5,
        bos_token_id=None,
        eos_token_id=None,
        activation_function="gelu",
    )
    with torch.random.fork_rng():
        torch.manual_seed(5)
        return HFCausalLM(transformers.AutoModelForCausalLM.from_config(config).eval())


class _EvenRowsLookup:
    """A lookup that stands behind a fixed proposal (1, 2, 3, ...) in the even rows of a batch only: deterministic
    (q one-hot) and independent of every draw, so a combined draft's passes mix rows that verify the lookup's
    tokens with rows that verify the model's, from the first pass on."""

    can_change_rows = True

    def start(self, prompts: list[list[int]], max_length: int) -> None:
        self.even = [row % 2 == 0 for row in range(len(prompts))]  # per row, from its place when it started

    def keep_rows(self, rows: list[int]) -> None:
        self.even = [self.even[row] for row in rows]

    def add_rows(self, prompts: list[list[int]]) -> None:
        self.even += [(len(self.even) + row) % 2 == 0 for row in range(len(prompts))]

    def confident(self, k: int) -> tuple[torch.Tensor, list[int]]:
        tokens = (torch.arange(k) % (VOCAB - 1) + 1).repeat(len(self.even), 1)  # [B, k]
        return tokens, [k if even else 0 for even in self.even]

    def take(self, proposal: torch.Tensor) -> None:
        pass

    def commit(self, num_accepted: list[int], next_token_ids: torch.Tensor, active: list[bool]) -> None:
        pass


# name -> factory(target) -> a fresh drafter. Every drafter family, and the quantized formats.
DRAFTERS = {
    "model": lambda target, cache: ModelDrafter(cache.setdefault("model", llama(1, 12))),
    # stops early: after 1 token where the draft's top probability is under 0.9 in every row (the first step here)
    "model-confident": lambda target, cache: ModelDrafter(
        cache.setdefault("model", llama(1, 12)), confidence_threshold=0.9
    ),
    "int8-target": lambda target, cache: ModelDrafter(
        cache.setdefault("int8", quantize_model(copy.deepcopy(target), 8))
    ),
    "int4-target": lambda target, cache: ModelDrafter(
        cache.setdefault("int4", quantize_model(copy.deepcopy(target), 4, 32))
    ),
    "early-exit": lambda target, cache: EarlyExitDrafter(target, 1),
    "ngram": lambda target, cache: PromptLookupDrafter(),
    "suffix": lambda target, cache: SuffixDrafter(),
    "suffix+model": lambda target, cache: CombinedDrafter(
        SuffixDrafter(), ModelDrafter(cache.setdefault("model", llama(1, 12)))
    ),
    "even-rows-lookup+model": lambda target, cache: CombinedDrafter(
        _EvenRowsLookup(), ModelDrafter(cache.setdefault("model", llama(1, 12)))
    ),
    "hf-gpt2": lambda target, cache: ModelDrafter(cache.setdefault("gpt2", _gpt2_draft())),
}


@pytest.fixture(scope="module")
def target():
    return llama(2, 11)


@pytest.fixture(scope="module")
def made():
    return {}  # draft models built once per module


def _exact_joint(model, params: SamplingParams) -> np.ndarray:
    """The exact joint distribution of TOKENS tokens after PROMPT under model's own logits (by enumeration)."""
    probs = np.zeros((VOCAB,) * TOKENS)
    with torch.no_grad():
        for prefix in itertools.product(range(VOCAB), repeat=TOKENS - 1):
            p = (
                process_logits(model(torch.tensor([PROMPT + list(prefix)]))[0, len(PROMPT) - 1 :], params)
                .double()
                .numpy()
            )
            probs[prefix] = p[0, prefix[0]] * p[1, prefix[1]] * p[2]
    return probs.ravel()


@pytest.fixture(scope="module")
def exact(target):
    """Exact joint probabilities [V**3] of the next 3 tokens after PROMPT, by enumeration."""
    return _exact_joint(target, SamplingParams(**SETTING))


def joint_counts(target, drafter, params: SamplingParams, n: int = N, k: int = 3):
    stats = SpecStats()
    tokens = np.asarray(generate_all(target, [PROMPT] * n, params, drafter, k=k, stats=stats))
    assert tokens.shape == (n, TOKENS)
    return np.bincount(np.ravel_multi_index(tokens.T, (VOCAB,) * TOKENS), minlength=VOCAB**TOKENS), stats


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_joint_distribution_of_three_tokens_is_exact(target, made, exact, name):
    params = SamplingParams(**SETTING, seed=300 + sorted(DRAFTERS).index(name), max_new_tokens=TOKENS)
    counts, stats = joint_counts(target, DRAFTERS[name](target, made), params)
    assert_distributed_as(counts, exact, are_counts=True, label=f"{name} {SETTING} k=3")
    assert 0 < stats.accepted < stats.proposed, stats.summary()  # both branches of the rule ran


@pytest.fixture(scope="module")
def plain_greedy(target):
    return generate_all(target, GREEDY_PROMPTS, GREEDY)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_greedy_output_equals_plain_greedy(target, made, plain_greedy, name, k):
    stats = SpecStats()
    assert generate_all(target, GREEDY_PROMPTS, GREEDY, DRAFTERS[name](target, made), k=k, stats=stats) == plain_greedy
    assert stats.proposed > 0


class DeclaresFlatQ(ModelDrafter):
    """Wrong: draws from the draft model's peaked q but declares a flat one."""

    def propose(self, k, sampling):
        token_ids, _ = super().propose(k, sampling)
        return token_ids, torch.full((*token_ids.shape, VOCAB), 1.0 / VOCAB)


def test_negative_control_drafter_declares_the_wrong_q(target, made, exact):
    params = SamplingParams(**SETTING, seed=7, max_new_tokens=TOKENS)
    counts, _ = joint_counts(target, DeclaresFlatQ(made.setdefault("model", llama(1, 12))), params, n=10_000)
    assert not is_distributed_as(counts, exact, are_counts=True)


def test_negative_control_target_sampled_at_the_wrong_temperature(target, made, exact):
    params = SamplingParams(temperature=1.0, top_k=4, seed=8, max_new_tokens=TOKENS)  # exact is for 0.8
    counts, _ = joint_counts(target, EarlyExitDrafter(target, 1), params, n=10_000)
    assert not is_distributed_as(counts, exact, are_counts=True)


# ---------------------------------------------------------------------------------------------
# llama.cpp as target and as draft: the same toy models converted to GGUF (f32)
# ---------------------------------------------------------------------------------------------

LLAMACPP_CHUNK = 256  # llama.cpp runs at most 256 sequences at once: the N draws go in chunks


@pytest.fixture(scope="module")
def gguf(tmp_path_factory, target):
    """The target (2 layers) and the model draft (1 layer, seed 12) as GGUF files on llama.cpp."""
    from verispec.llamacpp import LlamaCppModel
    from verispec.models.checkpoint import save_pretrained
    from verispec.models.gguf_convert import convert

    directory = tmp_path_factory.mktemp("gguf")
    models = {}
    for name, model in (("target", target), ("draft", llama(1, 12))):
        save_pretrained(model, directory / name)
        models[name] = LlamaCppModel(convert(directory / name, directory / f"{name}.gguf", "f32"), n_threads=1)
    return models


@pytest.fixture(scope="module")
def exact_llamacpp(gguf):
    """The exact joint distribution under the llama.cpp target's own logits."""
    return _exact_joint(gguf["target"], SamplingParams(**SETTING))


def _chunked_counts(target, make_drafter, seed: int, n: int = N):
    """joint_counts over chunks of LLAMACPP_CHUNK rows, each chunk with its own seed."""
    counts, stats = np.zeros(VOCAB**TOKENS, dtype=np.int64), SpecStats()
    for chunk, start in enumerate(range(0, n, LLAMACPP_CHUNK)):
        params = SamplingParams(**SETTING, seed=seed * 1000 + chunk, max_new_tokens=TOKENS)
        part, part_stats = joint_counts(target, make_drafter(), params, n=min(LLAMACPP_CHUNK, n - start))
        counts += part
        for request in part_stats.requests:
            stats.add(request)
    return counts, stats


# (target on, drafter): a llama.cpp target with a llama.cpp / PyTorch / no-model draft;
# a PyTorch target with a llama.cpp draft
LLAMACPP_CASES = {
    "llamacpp-target+llamacpp-draft": ("llamacpp", lambda g, made: ModelDrafter(g["draft"])),
    "llamacpp-target+llamacpp-draft-confident": (
        "llamacpp",
        lambda g, made: ModelDrafter(g["draft"], confidence_threshold=0.9),
    ),
    "llamacpp-target+torch-draft": ("llamacpp", lambda g, made: ModelDrafter(made.setdefault("model", llama(1, 12)))),
    "llamacpp-target+ngram": ("llamacpp", lambda g, made: PromptLookupDrafter()),
    "llamacpp-target+suffix": ("llamacpp", lambda g, made: SuffixDrafter()),
    "llamacpp-target+suffix+llamacpp-draft": (
        "llamacpp",
        lambda g, made: CombinedDrafter(SuffixDrafter(), ModelDrafter(g["draft"])),
    ),
    "llamacpp-target+even-rows-lookup+llamacpp-draft": (  # passes that mix the lookup's rows and the model's
        "llamacpp",
        lambda g, made: CombinedDrafter(_EvenRowsLookup(), ModelDrafter(g["draft"])),
    ),
    "torch-target+llamacpp-draft": ("torch", lambda g, made: ModelDrafter(g["draft"])),
}


@pytest.mark.parametrize("case", sorted(LLAMACPP_CASES))
def test_joint_distribution_is_exact_on_llama_cpp(target, gguf, made, exact, exact_llamacpp, case, monkeypatch):
    """A llama.cpp target runs its compiled step with every drafter here (the torch draft aside); a combined draft
    that mixes its rows mixes them in the compiled call (`given_rows`)."""
    from verispec.llamacpp import CompiledStep

    on, make = LLAMACPP_CASES[case]
    model, reference = (gguf["target"], exact_llamacpp) if on == "llamacpp" else (target, exact)
    steps, drafters, maybe = [], [], CompiledStep.maybe
    monkeypatch.setattr(CompiledStep, "maybe", classmethod(lambda cls, *args: steps.append(maybe(*args)) or steps[-1]))
    counts, stats = _chunked_counts(
        model, lambda: drafters.append(make(gguf, made)) or drafters[-1], seed=400 + sorted(LLAMACPP_CASES).index(case)
    )
    assert_distributed_as(counts, reference, are_counts=True, label=f"{case} {SETTING} k=3")
    assert 0 < stats.accepted < stats.proposed, stats.summary()
    if on == "llamacpp" and "torch-draft" not in case:
        assert steps and all(step is not None for step in steps)
    if "even-rows" in case:
        assert all(step.combined for step in steps) and all(d.mixed_passes > 0 for d in drafters)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("case", sorted(LLAMACPP_CASES))
def test_greedy_output_equals_plain_greedy_on_llama_cpp(target, gguf, made, plain_greedy, case, k):
    on, make = LLAMACPP_CASES[case]
    model = gguf["target"] if on == "llamacpp" else target
    plain = generate_all(model, GREEDY_PROMPTS, GREEDY) if on == "llamacpp" else plain_greedy
    stats = SpecStats()
    assert generate_all(model, GREEDY_PROMPTS, GREEDY, make(gguf, made), k=k, stats=stats) == plain
    assert stats.proposed > 0


# The compiled step (llamacpp/step.py, llamacpp/llama_step.c) runs the rule itself at a
# temperature, with top-k, top-p and min-p, the draft proposing from q sharpened by its proposal
# temperature: the same test, on those settings, through it.
TEMPERATURE_ONLY = dict(temperature=0.8)
TRUNCATED = dict(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05)


@pytest.fixture(scope="module")
def exact_llamacpp_temperature_only(gguf):
    return _exact_joint(gguf["target"], SamplingParams(**TEMPERATURE_ONLY))


@pytest.fixture(scope="module")
def exact_llamacpp_truncated(gguf):
    return _exact_joint(gguf["target"], SamplingParams(**TRUNCATED))


COMPILED_CHUNK = (
    LLAMACPP_CHUNK  # rows per call (the compiled step takes B * (k + 1) <= max(512, 9B) positions in one batch)
)


def _compiled_counts(
    gguf, threshold: float | None, setting: dict, seed: int, n: int, monkeypatch, tau=None, tell_q: bool = False
):
    """Joint counts through the compiled step, which must be the one running every chunk; the draft
    proposes from q sharpened by `tau` (None: auto); tell_q: the rule is told q instead (inexact)."""
    from verispec.llamacpp import CompiledStep

    made, maybe = [], CompiledStep.maybe

    def offer(cls, *args):
        made.append(maybe(*args))
        if made[-1] is not None and tell_q:
            made[-1].tell_q()
        return made[-1]

    monkeypatch.setattr(CompiledStep, "maybe", classmethod(offer))
    counts, stats = np.zeros(VOCAB**TOKENS, dtype=np.int64), SpecStats()
    for chunk, start in enumerate(range(0, n, COMPILED_CHUNK)):
        params = SamplingParams(**setting, seed=seed * 1000 + chunk, max_new_tokens=TOKENS)
        drafter = None if threshold is None else ModelDrafter(gguf["draft"], threshold, tau)  # None: plain decoding
        part, part_stats = joint_counts(gguf["target"], drafter, params, n=min(COMPILED_CHUNK, n - start))
        counts += part
        for request in part_stats.requests:
            stats.add(request)
    assert made and all(step is not None for step in made), "the compiled step did not run every chunk"
    return counts, stats


@pytest.mark.parametrize("threshold", [0.0, 0.9, None])  # None: no drafter, plain sampling through the compiled step
def test_joint_distribution_is_exact_through_the_compiled_step(
    gguf, exact_llamacpp_temperature_only, threshold, monkeypatch
):
    counts, stats = _compiled_counts(
        gguf, threshold, TEMPERATURE_ONLY, 500 + int(10 * (threshold or 2)), N, monkeypatch
    )
    assert_distributed_as(
        counts,
        exact_llamacpp_temperature_only,
        are_counts=True,
        label=f"compiled step {TEMPERATURE_ONLY} k=3 p_min={threshold}",
    )
    assert 0 < stats.accepted < stats.proposed or (threshold is None and stats.proposed == 0), stats.summary()


def test_negative_control_the_compiled_step_at_the_wrong_temperature(
    gguf, exact_llamacpp_temperature_only, monkeypatch
):
    counts, _ = _compiled_counts(gguf, 0.0, dict(temperature=1.2), 9500, 10_000, monkeypatch)  # exact is for 0.8
    assert not is_distributed_as(counts, exact_llamacpp_temperature_only, are_counts=True)


@pytest.mark.parametrize("tau", [0.5, 0.0, None])  # None: --draft-temperature auto, chosen per row as it goes
def test_joint_distribution_is_exact_through_the_compiled_step_truncated_and_sharpened(
    gguf, exact_llamacpp_truncated, tau, monkeypatch
):
    counts, stats = _compiled_counts(
        gguf, 0.0, TRUNCATED, 600 + int(10 * (tau if tau is not None else 2)), N, monkeypatch, tau
    )
    assert_distributed_as(
        counts, exact_llamacpp_truncated, are_counts=True, label=f"compiled step {TRUNCATED} tau={tau}"
    )
    assert 0 < stats.accepted < stats.proposed, stats.summary()


def test_negative_control_the_compiled_rule_told_q_where_the_proposals_came_from_q_sharpened(
    gguf, exact_llamacpp_truncated, monkeypatch
):
    counts, _ = _compiled_counts(gguf, 0.0, TRUNCATED, 9600, 10_000, monkeypatch, 0.0, tell_q=True)
    assert not is_distributed_as(counts, exact_llamacpp_truncated, are_counts=True)


def test_negative_control_llama_cpp_target_against_the_pytorch_distribution(gguf, exact_llamacpp):
    """The llama.cpp target's own distribution is what the test compares with; sampling it at the
    wrong temperature must fail."""
    counts = np.zeros(VOCAB**TOKENS, dtype=np.int64)
    for chunk, start in enumerate(range(0, 10_000, LLAMACPP_CHUNK)):
        params = SamplingParams(temperature=1.0, top_k=4, seed=9000 + chunk, max_new_tokens=TOKENS)  # exact is for 0.8
        counts += joint_counts(
            gguf["target"], ModelDrafter(gguf["draft"]), params, n=min(LLAMACPP_CHUNK, 10_000 - start)
        )[0]
    assert not is_distributed_as(counts, exact_llamacpp, are_counts=True)


# ---------------------------------------------------------------------------------------------
# Drafter-invariant sampling (invariant.py): the joint distribution is exact, and speculative
# output equals plain output token for token, for every drafter family and draft length
# ---------------------------------------------------------------------------------------------

INVARIANT_DRAFTERS = ["model", "int8-target", "early-exit", "ngram", "suffix", "suffix+model"]


@pytest.mark.parametrize("name", INVARIANT_DRAFTERS + ["plain"])
def test_joint_distribution_is_exact_in_invariant_mode(target, made, exact, name):
    params = SamplingParams(
        **SETTING, seed=700 + (INVARIANT_DRAFTERS + ["plain"]).index(name), max_new_tokens=TOKENS, sampling="invariant"
    )
    counts, stats = joint_counts(target, None if name == "plain" else DRAFTERS[name](target, made), params)
    assert_distributed_as(counts, exact, are_counts=True, label=f"invariant {name} {SETTING} k=3")
    assert name == "plain" or 0 < stats.accepted < stats.proposed, stats.summary()


def test_negative_control_invariant_mode_with_uniform_instead_of_gumbel_noise(target, made, exact, monkeypatch):
    """argmax(log p + u) with u uniform is not a draw from p: the test must see it."""
    import verispec.invariant as invariant

    gumbel = invariant.gumbel_noise
    monkeypatch.setattr(invariant, "gumbel_noise", lambda *args: torch.exp(-torch.exp(-gumbel(*args))))  # u itself
    params = SamplingParams(**SETTING, seed=790, max_new_tokens=TOKENS, sampling="invariant")
    counts, _ = joint_counts(target, DRAFTERS["model"](target, made), params, n=10_000)
    assert not is_distributed_as(counts, exact, are_counts=True)


def _invariant_prompts(rows: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB, (int(torch.randint(1, 7, (1,), generator=generator)),), generator=generator).tolist()
        for _ in range(rows)
    ]


@pytest.mark.parametrize(
    "setting", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)], ids=["T=1", "T=0.7,top-p=0.9"]
)
def test_invariant_mode_gives_the_tokens_of_plain_decoding(target, made, setting):
    """1,000 (prompt, seed, row) streams per drafter and draft length: 5 seeds x 200 rows."""
    for seed in range(5):
        prompts = _invariant_prompts(200, seed)
        params = SamplingParams(**setting, seed=seed, max_new_tokens=12, sampling="invariant")
        plain = generate_all(target, prompts, params)
        for name in INVARIANT_DRAFTERS:
            for k in (1, 4, "auto"):
                policy = AdaptiveLength(k_max=4) if k == "auto" else k
                assert generate_all(target, prompts, params, DRAFTERS[name](target, made), k=policy) == plain, (
                    seed,
                    name,
                    k,
                )
        # negative control: rejection sampling with the same seed commits other tokens
        rejection = generate_all(
            target, prompts, replace(params, sampling="rejection"), DRAFTERS["model"](target, made), k=4
        )
        assert sum(a != b for a, b in zip(rejection, plain)) > 100


# A batch with different settings per row (sampling.RowSampling): each half of the rows is
# distributed as the target under its own settings.
OTHER_SETTING = dict(temperature=1.3)


@pytest.fixture(scope="module")
def exact_other(target):
    return _exact_joint(target, SamplingParams(**OTHER_SETTING))


def _mixed_counts(target, drafter, n: int, seed: int, second_mode: str = "invariant"):
    first = SamplingParams(**SETTING, max_new_tokens=TOKENS)
    second = SamplingParams(**OTHER_SETTING, max_new_tokens=TOKENS, sampling=second_mode)
    params = [replace(first if b % 2 == 0 else second, seed=row_seed(seed, b)) for b in range(n)]
    tokens = np.asarray(generate_all(target, [PROMPT] * n, params, drafter, k=3))
    cells = np.ravel_multi_index(tokens.T, (VOCAB,) * TOKENS)
    return [np.bincount(cells[half::2], minlength=VOCAB**TOKENS) for half in (0, 1)]


@pytest.mark.parametrize("name", ["model", "ngram"])
def test_joint_distribution_is_exact_per_row_in_a_batch_of_mixed_settings(target, made, exact, exact_other, name):
    counts = _mixed_counts(target, DRAFTERS[name](target, made), 2 * N, seed=900 + ["model", "ngram"].index(name))
    assert_distributed_as(counts[0], exact, are_counts=True, label=f"{name} rows at {SETTING}, rejection")
    assert_distributed_as(counts[1], exact_other, are_counts=True, label=f"{name} rows at {OTHER_SETTING}, invariant")


def test_joint_distribution_is_exact_per_row_with_interleaved_settings_of_one_mode(target, made, exact, exact_other):
    """Every row in rejection mode, two settings on alternate rows: the mode's rows are not one
    run of the batch (a draw once handed row 1's token to row 2 here)."""
    counts = _mixed_counts(target, DRAFTERS["model"](target, made), N, seed=950, second_mode="rejection")
    assert_distributed_as(counts[0], exact, are_counts=True, label=f"rows at {SETTING} between rows at {OTHER_SETTING}")
    assert_distributed_as(
        counts[1], exact_other, are_counts=True, label=f"rows at {OTHER_SETTING} between rows at {SETTING}"
    )


def test_negative_control_every_row_processed_with_the_first_rows_settings(
    target, made, exact, exact_other, monkeypatch
):
    from verispec.sampling import RowSampling

    first = SamplingParams(**SETTING)  # not self.params[0]: row 0 leaves the batch when it finishes
    monkeypatch.setattr(RowSampling, "process", lambda self, logits: process_logits(logits, first))
    counts = _mixed_counts(target, DRAFTERS["model"](target, made), 20_000, seed=990)
    assert is_distributed_as(counts[0], exact, are_counts=True)  # the first rows are right
    assert not is_distributed_as(counts[1], exact_other, are_counts=True)
