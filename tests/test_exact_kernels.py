"""Exact against plain decoding on every GGUF type: llama.cpp's pass-shape invariance.

A toy target with rows of 256 values (so that K-quants and IQ4 apply to every matrix) is
converted to f32 and quantized by llama.cpp's own quantizer to the types users download. With
verispec's exact kernels (the default) a position's logits must not depend on the pass that
computes them (one position or several, one row or two, a small or a large cache), and greedy
speculative decoding must give plain decoding's tokens, with a model draft and with prompt
lookup, at k = 1, 2, 4 and auto, one row and a batch, on the Python path and the compiled step.
Three regimes: sgemm's attention with no sequence of one token, flash attention with a
placeholder past its split (files whose matrices all take dot-product kernels), and flash
attention with a placeholder after every pass of one position (files with a matrix llamafile's
sgemm takes). Negative controls: the same measurement without the placeholders finds a gap on
f16, without the placeholder per row of one token on f16, without flash attention's past the
split on Q4_K_M, without the one-position placeholder under flash attention on f16; a process
with `--exact-kernels off` finds one on Q4_K_M.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from verispec import AdaptiveLength, ModelDrafter, PromptLookupDrafter, SamplingParams, generate_all
from verispec.llamacpp import GGUFTokenizer, LlamaCppModel, exact_kernels, unavailable
from verispec.llamacpp.deviation import pass_shape_deviation
from verispec.llamacpp.head import width_dependent
from verispec.llamacpp.quantize import QUANT_TYPES, quant_type, quantize
from verispec.models.gguf_convert import convert
from verispec.models.toy import make_toy_pair

pytestmark = pytest.mark.skipif(unavailable() is not None, reason="llama.cpp does not run here")

TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS"]
TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef add",
    "for i in range(10):\n    print(i)\nfor i in",
    "x = x + 1\ny = y + 1\nx = x",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("kquant")
    target_dir, draft_dir = make_toy_pair(root, sizes="kquant")
    f32 = convert(target_dir, root / "target-F32.gguf", "f32")
    found = {"F32": f32, "draft": convert(draft_dir, root / "draft.gguf", "f32")}
    for name in TYPES:
        found[name] = quantize(f32, root / f"target-{name}.gguf", name, threads=1)
    return found


@pytest.fixture(scope="module")
def draft(files):
    model = LlamaCppModel(files["draft"], n_threads=2)
    model.shape_invariant = False  # a draft's logits need not be invariant: q is whatever it computed
    return model


def _contexts(model) -> list[list[int]]:
    tokenizer = GGUFTokenizer(model)
    return [tokenizer.encode(text * 3).ids for text in TEXTS]


def test_exact_kernels_are_the_default():
    assert exact_kernels()


@pytest.mark.parametrize("name", ["F32", *TYPES])
def test_logits_do_not_depend_on_the_pass_shape(files, name):
    model = LlamaCppModel(files[name], n_threads=2)
    found = pass_shape_deviation(model, _contexts(model))
    assert found.largest == 0.0, found


def test_an_f32_kv_cache_is_shape_invariant_too(files):
    model = LlamaCppModel(files["Q8_0"], n_threads=2, kv_type="f32")
    assert pass_shape_deviation(model, _contexts(model)).largest == 0.0


def test_without_the_placeholders_the_pass_shape_shows(files):
    """The negative control: the measurement finds the one-token kernels of llamafile's sgemm."""
    model = LlamaCppModel(files["F16"], n_threads=2)
    model.shape_invariant = False
    assert pass_shape_deviation(model, _contexts(model)).largest > 0


def test_with_exact_kernels_off_a_k_quant_depends_on_the_pass_shape(files):
    """The negative control for the process-wide settings (repacking, ggml's tiled K-quant product):
    a fresh process with them at llama.cpp's defaults measures a gap on Q4_K_M."""
    code = (
        "import json, sys; from verispec import llamacpp; llamacpp.set_exact_kernels(False); "
        "from verispec.llamacpp.deviation import pass_shape_deviation; from verispec.llamacpp import GGUFTokenizer, "
        "LlamaCppModel; "
        f"m = LlamaCppModel(sys.argv[1], n_threads=2); t = GGUFTokenizer(m); "
        f"print(json.dumps(pass_shape_deviation(m, [t.encode(x * 3).ids for x in {TEXTS!r}]).largest))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(files["Q4_K_M"])], capture_output=True, text=True, timeout=300, check=True
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) > 0


@pytest.mark.parametrize("name", ["F32", "F16", "Q8_0"])
def test_flash_attention_over_sgemm_weights_is_shape_invariant(files, name):
    """The third regime (`--flash-attn on` for a file with a matrix sgemm takes): flash attention,
    and a placeholder after every pass of one position (its matrices' one-column kernel) where the
    type's product depends on the width on this CPU (head.width_dependent: Q8_0's does not on some)."""
    model = LlamaCppModel(files[name], n_threads=2)
    model.flash_attention = True
    assert model.new_cache(1, 8).context.lone_pad == bool(width_dependent({name}))
    contexts = _contexts(model)
    assert pass_shape_deviation(model, contexts + [(c * 40)[:300] for c in contexts[:1]]).largest == 0.0


def test_without_the_lone_placeholder_flash_attention_over_sgemm_weights_shows(files):
    """Its negative control: no placeholder after a one-token pass (as for a K-quant file) on F16."""
    model = LlamaCppModel(files["F16"], n_threads=2)
    model.flash_attention, model.sgemm_weights = True, False
    assert pass_shape_deviation(model, _contexts(model)).positions > 0


@pytest.mark.parametrize(
    "name, flash",
    [(name, None) for name in ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL"]]
    + [("F32", True), ("F16", True), ("F16", False)],
)
def test_greedy_speculative_equals_plain_on_every_type(files, draft, name, flash, monkeypatch):
    target = LlamaCppModel(files[name], n_threads=2)
    if flash is not None:  # else --flash-attn auto's choice
        target.flash_attention = flash
    prompts = _contexts(target)
    params = SamplingParams(temperature=0, max_new_tokens=24)
    with monkeypatch.context() as plain_only:  # the reference: plain decoding, no guess in a placeholder
        plain_only.setenv("VERISPEC_PLACEHOLDER_GUESS", "0")
        plain = [generate_all(target, [p], params, None, k=0)[0] for p in prompts]
    assert generate_all(target, prompts, params, None, k=0) == plain  # a batch, plain
    for k in (1, 2, 4, "auto"):
        for make in (lambda: ModelDrafter(draft), PromptLookupDrafter):
            policy = AdaptiveLength(k_max=4) if k == "auto" else k
            for prompt, expected in zip(prompts, plain):
                assert generate_all(target, [prompt], params, make(), k=policy)[0] == expected, (name, k)
    assert generate_all(target, prompts, params, ModelDrafter(draft), k=3) == plain  # a batch, rows stopping apart


@pytest.mark.parametrize("name, flash", [("F32", None), ("F16", True), ("F16", False)])
def test_a_guess_in_the_placeholder_keeps_plain_decodings_tokens(files, name, flash, monkeypatch):
    """No draft on a target that pads every one-position pass (drafters/placeholder.py): the
    placeholder's position checks a guess. The tokens are plain decoding's (greedy, and sampled
    with a seed: the coupled rule draws one number per committed token), and guesses are made
    and taken. Control: a K-quant file under flash attention pads no such pass of a short row, so guesses none."""
    from verispec.stats import SpecStats

    target = LlamaCppModel(files[name], n_threads=2)
    if flash is not None:
        target.flash_attention = flash
    assert target.pads_lone_passes
    prompts = _contexts(target)
    settings = [SamplingParams(temperature=0, max_new_tokens=24)]
    settings += [SamplingParams(temperature=1.0, max_new_tokens=24, seed=seed) for seed in (0, 1)]
    for params in settings:
        monkeypatch.setenv("VERISPEC_PLACEHOLDER_GUESS", "0")
        plain_stats = SpecStats()
        plain = [generate_all(target, [p], params, None, k=0, stats=plain_stats)[0] for p in prompts]
        monkeypatch.setenv("VERISPEC_PLACEHOLDER_GUESS", "1")
        stats = SpecStats()
        assert [generate_all(target, [p], params, None, k=0, stats=stats)[0] for p in prompts] == plain, params
        assert plain_stats.proposed == 0 and stats.placeholder_guess and stats.proposed > 0
        if params.temperature == 0:  # repeated text: some guesses are right, and a pass then commits two tokens
            assert stats.accepted > 0 and stats.target_passes < plain_stats.target_passes
    control = LlamaCppModel(files["Q4_K_M"], n_threads=2)
    control.flash_attention = True
    stats = SpecStats()
    generate_all(control, _contexts(control)[:1], settings[0], None, k=0, stats=stats)
    assert not control.pads_lone_passes and stats.proposed == 0  # short rows: no placeholder, so no guess


@pytest.mark.parametrize("name", ["Q4_K_M", "F16"])
def test_the_compiled_step_pads_a_lone_row_between_finished_ones(files, draft, name, monkeypatch):
    """Rows finish at different steps: the compiled step's target pass then has gaps between its
    sequences (placeholders) and, at the end, one row of one token (a second placeholder; on F16
    under flash attention, the placeholder of a pass of one position)."""
    target = LlamaCppModel(files[name], n_threads=2)
    target.flash_attention = True
    prompts = _contexts(target)
    budgets = [SamplingParams(temperature=0, max_new_tokens=n) for n in (30, 6, 18)]
    with monkeypatch.context() as plain_only:  # the reference: plain decoding, no guess in a placeholder
        plain_only.setenv("VERISPEC_PLACEHOLDER_GUESS", "0")
        plain = [generate_all(target, [p], b, None, k=0)[0] for p, b in zip(prompts, budgets)]
    assert generate_all(target, prompts, budgets, ModelDrafter(draft), k=2) == plain
    assert generate_all(target, prompts, budgets, None, k=0) == plain


def _last_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """Logits [B, V] of one more token after each prompt, the prompts written together."""
    cache = model.new_cache(len(prompts), 600)
    model.prefill(prompts, cache)
    return model(torch.tensor([[5]] * len(prompts)), cache)[:, 0]


PROMPT_PAIRS = [(100, 30), (300, 20), (63, 64), (255, 258)]


@pytest.mark.parametrize("name, flash", [("Q4_K_M", True), ("F16", True), ("F16", False)])
def test_a_prompt_written_beside_others_gets_the_cells_it_gets_alone(files, name, flash):
    """A batch's prompts (a server's rows joining together, `generate` of several prompts) are
    written in one decode: padded to one length, or cut where the batch reaches llama.cpp's
    batch size. A row's next logits must equal those of its prompt written alone."""
    model = LlamaCppModel(files[name], n_threads=2)
    model.flash_attention = flash
    texts = [(c * 40) for c in _contexts(model)[:2]]
    for a, b in PROMPT_PAIRS:
        prompts = [texts[0][:a], texts[1][:b]]
        alone = torch.cat([_last_logits(model, [p]) for p in prompts])
        assert torch.equal(_last_logits(model, prompts), alone), (name, flash, a, b)


def test_prompts_written_together_under_flash_attention_show_the_tiled_kernel(files, monkeypatch):
    """The negative control: without writing each prompt on its own, a prompt padded to 64
    queries or more (or cut at the batch size) takes flash attention's tiled kernel."""
    from verispec.llamacpp import context

    monkeypatch.setattr(context, "TILED_FROM", 10**9)
    model = LlamaCppModel(files["Q4_K_M"], n_threads=2)
    texts = [(c * 40) for c in _contexts(model)[:2]]
    prompts = [texts[0][:100], texts[1][:30]]
    alone = torch.cat([_last_logits(model, [p]) for p in prompts])
    assert (_last_logits(model, prompts) - alone).abs().max() > 0


@pytest.mark.parametrize("name, flash, blocks", [("Q4_K_M", True, True), ("F16", True, True), ("Q4_K_M", True, False)])
def test_a_prompt_read_in_pieces_gets_the_cells_it_gets_whole(files, monkeypatch, name, flash, blocks):
    """A server reads a long prompt 256 tokens a pass (--prefill-chunk); `generate` writes it in one
    call. Under flash attention both cut it at the same positions (context.PROMPT_BLOCK), so the
    next logits are equal. The negative control (blocks off): written whole, the prompt's last 44
    tokens run in the tiled kernel with the rest; read in pieces they do not, and the logits differ."""
    from verispec.llamacpp import context

    if not blocks:
        monkeypatch.setattr(context, "PROMPT_BLOCK", 10**9)
    model = LlamaCppModel(files[name], n_threads=2)
    model.flash_attention = flash
    prompt = (_contexts(model)[0] * 40)[:300]
    whole = _last_logits(model, [prompt])
    cache = model.new_cache(1, 600)
    model.prefill([prompt[:256]], cache)
    model.write(torch.tensor([prompt[256:]]), cache)
    pieces = model(torch.tensor([[5]]), cache)[:, 0]
    assert torch.equal(pieces, whole) == blocks


@pytest.mark.parametrize("small_first", [False, True])
def test_a_reused_context_cuts_a_prompt_as_a_fresh_one_does(files, monkeypatch, small_first):
    """A cache made for 8 positions leaves its context to the next cache that fits (llama.cpp
    pads it to 256 cells); the prompt written there must get the cells it gets in a fresh one.
    The negative control (small_first with llama.cpp's batch capped at the context's size, as
    before): the prompt is cut into passes of 8, and the logits differ."""
    from verispec.llamacpp import context

    model = LlamaCppModel(files["Q4_K_M"], n_threads=2)
    prompt = (_contexts(model)[0] * 4)[:120]
    fresh = _last_logits(model, [prompt])
    model._spare = None
    if small_first:
        monkeypatch.setattr(context, "_cells", lambda n_seq, n_ctx_seq, capacity: n_seq * n_ctx_seq)
    model.new_cache(1, 8)  # dropped at once: its context is the model's spare now
    spare = model._spare
    cache = model.new_cache(1, 130)
    assert cache.context is spare
    model.prefill([prompt], cache)
    reused = model(torch.tensor([[5]]), cache)[:, 0]
    assert torch.equal(reused, fresh) != small_first


def test_quantize_takes_llama_quantize_names_and_refuses_others(files, tmp_path):
    assert quant_type("q4_k_m") == "Q4_K_M" and "IQ4_XS" in QUANT_TYPES
    with pytest.raises(ValueError, match="Q4_K_M"):
        quant_type("q4_k_x")
    requantized = quantize(files["Q8_0"], tmp_path / "again.gguf", "Q4_0")  # a quantized input is requantized
    assert LlamaCppModel(requantized, n_threads=1)(torch.tensor([[1, 2, 3]])).shape == (1, 3, 257)


def _spin_count(env: dict) -> str | None:
    import os

    code = "import os, verispec; print(os.environ.get('GOMP_SPINCOUNT'))"
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.strip()


def test_openmp_threads_spin_briefly_unless_the_user_chose():
    """llama.cpp's OpenMP threads spin 1,000 times at a barrier, not libgomp's 300,000, so that a
    waiting thread sleeps soon instead of spinning against another process on the same cores; a user's
    own setting is kept (the negative control: what verispec sets is seen only when nothing is set)."""
    assert _spin_count({}) == "1000"
    assert _spin_count({"GOMP_SPINCOUNT": "5"}) == "5"
    assert _spin_count({"OMP_WAIT_POLICY": "ACTIVE"}) == "None"


@pytest.mark.parametrize("name", ["F32", "Q4_K_M", "IQ4_NL"])
def test_logits_do_not_depend_on_the_thread_count(files, name):
    one, two = LlamaCppModel(files[name], n_threads=1), LlamaCppModel(files[name], n_threads=2)
    ids = _contexts(one)[0]
    assert torch.equal(one(torch.tensor([ids])), two(torch.tensor([ids])))


@pytest.mark.parametrize("name", ["F16", "Q8_0", "Q4_K_M"])
def test_past_256_cells_the_pass_shape_still_does_not_matter(files, name):
    """Contexts of 300 tokens: passes read 512 cells (llama.cpp pads the cells it reads to 256)."""
    model = LlamaCppModel(files[name], n_threads=2)
    contexts = [(c * 40)[:300] for c in _contexts(model)[:2]]
    assert pass_shape_deviation(model, contexts).largest == 0.0


def test_without_a_placeholder_per_row_one_token_rows_show_the_pass_shape(files, monkeypatch):
    """The negative control of the per-row placeholder under sgemm's attention (F16): rows of one
    token each in a pass of two rows take attention's one-query kernel (ggml's vec_dot_f16)."""
    from verispec.llamacpp import context

    fill = context.Context._fill_gaps
    monkeypatch.setattr(
        context.Context, "_fill_gaps", lambda self, seqs, positions, always=False: fill(self, seqs, positions)
    )
    model = LlamaCppModel(files["F16"], n_threads=2)
    model.flash_attention = False
    found = pass_shape_deviation(model, _contexts(model))
    assert found.positions == 0.0 and found.rows > 0, found


def test_without_the_placeholder_past_the_split_the_pass_shape_shows(files, monkeypatch):
    """The negative control of flash attention's placeholder: none at any position on a file whose
    matrices all take dot-product kernels (Q4_K_M: flash attention), and the split shows at 300 tokens."""
    from verispec.llamacpp import context

    monkeypatch.setattr(context, "SPLIT_KV_FROM", 10**9)
    model = LlamaCppModel(files["Q4_K_M"], n_threads=2)
    contexts = [(c * 40)[:300] for c in _contexts(model)[:2]]
    assert model.new_cache(1, 8).context.flash
    assert pass_shape_deviation(model, contexts).largest > 0


def test_past_the_split_the_placeholder_in_the_spare_sequence_keeps_plain_decoding(files, draft, monkeypatch):
    """Flash attention over dot-product weights (Q4_K_M): past SPLIT_KV_FROM a one-token pass puts
    its placeholder in the spare sequence (context.py `_in_spare`; llama_step.c invariant 4), in the
    row's KV stream for a one-row context (`unified`), where it attends to one cell instead of the
    row's. The row's logits keep the pass shape's invariance at 300 tokens (the control above, with no
    placeholder, shows the split), and decoding gives the tokens of the placeholder after the token
    (the spare turned off), plain and speculative, on the Python path and the compiled step."""
    from verispec.llamacpp import context

    monkeypatch.setenv("VERISPEC_PLACEHOLDER_GUESS", "0")  # plain's lone passes carry the placeholder, not a guess
    used = []
    in_spare = context.Context._in_spare
    monkeypatch.setattr(context.Context, "_in_spare", lambda self, *a: used.append(in_spare(self, *a)) or used[-1])
    model = LlamaCppModel(files["Q4_K_M"], n_threads=2)
    model.flash_attention = True
    contexts = [(c * 40)[:300] for c in _contexts(model)[:2]]
    one_row = model.new_cache(1, 8).context
    assert one_row.spare_seq == 1 and one_row.unified  # the row and the spare share a KV stream
    assert pass_shape_deviation(model, contexts).largest == 0.0 and any(used)
    params = SamplingParams(temperature=0, max_new_tokens=24)
    spare = [generate_all(model, [p], params, None, k=0)[0] for p in contexts]
    assert generate_all(model, contexts[:1], params, ModelDrafter(draft), k=2)[0] == spare[0]
    assert generate_all(model, contexts[:1], params, PromptLookupDrafter(), k=3)[0] == spare[0]
    original = context.Context.__init__

    def without_spare(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.spare_seq = None

    monkeypatch.setattr(context.Context, "__init__", without_spare)
    model._spare = None
    assert [generate_all(model, [p], params, None, k=0)[0] for p in contexts] == spare


def test_a_server_row_alone_puts_its_placeholder_in_the_free_slot_after_it(files, monkeypatch):
    """A context of two rows (a server's slots) whose second row left: the first row's one-position passes past
    SPLIT_KV_FROM put their placeholder in the emptied sequence after it (context.py `_in_spare`, llama_step.c),
    not after its own token. The lone pass's logits equal a two-position pass's bit for bit (Python path), and
    decoding two prompts, one of which ends early, gives the long row the tokens it has alone (compiled step)."""
    from verispec.llamacpp import context

    monkeypatch.setenv("VERISPEC_PLACEHOLDER_GUESS", "0")
    seqs_used = []
    in_spare = context.Context._in_spare

    def spy(self, tokens, seqs):
        found = in_spare(self, tokens, seqs)
        seqs_used.append((int(seqs[0]), self.spare_seq, found))
        return found

    monkeypatch.setattr(context.Context, "_in_spare", spy)
    model = LlamaCppModel(files["Q4_K_M"], n_threads=2)
    model.flash_attention = True
    long, other = [(c * 40)[:300] for c in _contexts(model)[:2]]
    both = model.new_cache(2, 340)
    assert both.context.spare_seq == 2 and not both.context.unified
    model.prefill([long[:-1], other[:-1]], both)
    both.keep_rows([0])  # the second row leaves: its sequence is emptied
    tail = torch.tensor([long[-1:]])
    lone = model(tail, both)[0, 0]  # [V]
    assert seqs_used[-1] == (0, 2, True)  # the placeholder went to sequence 1, not after the row's token
    both.rollback([len(long) - 1])
    pair = model(torch.tensor([long[-1:] + long[:1]]), both)[0, 0]
    assert torch.equal(lone, pair)
    params = [SamplingParams(temperature=0, max_new_tokens=24), SamplingParams(temperature=0, max_new_tokens=2)]
    alone = generate_all(model, [long], params[0], None, k=0)[0]
    assert generate_all(model, [long, other], params, None, k=0)[0] == alone


@pytest.mark.parametrize("name", ["Q4_K_M", "Q4_1"])
def test_past_the_split_a_lone_pass_checks_a_guess(files, name, monkeypatch):
    """Flash attention over dot-product weights: from `lone_pad_from` (SPLIT_KV_FROM + 1) on, plain decoding's
    one-position passes carry a guess in the row's own sequence where they carried the spare sequence's placeholder
    (drafters/placeholder.py). The tokens are plain decoding's with the guess off (greedy, and sampled with a seed);
    guesses are made past the split, right ones commit two tokens a pass, and a row that stays short guesses nothing
    (its passes have no placeholder). The gate on the guesses' accuracy is off here (test_suffix.py tests it)."""
    from verispec.llamacpp.context import SPLIT_KV_FROM
    from verispec.stats import SpecStats

    model = LlamaCppModel(files[name], n_threads=2)
    model.flash_attention = True
    assert model.lone_pad_from == SPLIT_KV_FROM + 1 and not model.pads_lone_passes
    assert 0 < model.query_cost_per_cell < 0.01  # a tiny model: its guesses pay only above 0.25 at 300 cells
    monkeypatch.setattr(LlamaCppModel, "query_cost_per_cell", 0.0)  # guess whatever (the gate: test_suffix.py)
    long = [(c * 40)[:300] for c in _contexts(model)[:2]]
    short = [c[:100] for c in long]
    settings = [SamplingParams(temperature=0, max_new_tokens=24)]
    settings += [SamplingParams(temperature=1.0, max_new_tokens=24, seed=seed) for seed in (0, 1)]
    for params in settings:
        for prompts, guessed in ((long, True), (short, False)):
            monkeypatch.setenv("VERISPEC_PLACEHOLDER_GUESS", "0")
            plain = [generate_all(model, [p], params, None, k=0)[0] for p in prompts]
            monkeypatch.setenv("VERISPEC_PLACEHOLDER_GUESS", "1")
            stats = SpecStats()
            assert [generate_all(model, [p], params, None, k=0, stats=stats)[0] for p in prompts] == plain, params
            assert (stats.proposed > 0) == guessed, (params, guessed)
            if guessed and params.temperature == 0:  # repeated text: right guesses, two tokens in such a pass
                assert stats.accepted > 0 and stats.target_passes < sum(len(p) for p in plain)
    from verispec.drafters.placeholder import PlaceholderGuesser
    from verispec.engine import Batch

    # a batch none of whose rows can reach lone_pad_from runs plain passes, without the guesser's lookups; one
    # whose budget may take a row there keeps it
    budget = SamplingParams(temperature=0, max_new_tokens=model.lone_pad_from - 100 - 2)
    assert Batch(model, short[:1], budget).drafter is None
    longer = SamplingParams(temperature=0, max_new_tokens=model.lone_pad_from - 100)
    assert isinstance(Batch(model, short[:1], longer).drafter, PlaceholderGuesser)
