"""The llama.cpp backend (`verispec.llamacpp`): a GGUF file behind the model protocol.

- Cache contract: a forward after a rollback gives the logits of a fresh prefill of the
  committed tokens; rows of a batch are independent (ragged prefill, per-row rollback).
- The same weights as verispec's PyTorch model (converted f32): the same logits up to the
  f16 KV cache's rounding.
- Greedy speculative decoding of the built-in pair on llama.cpp gives exactly the tokens of
  llama.cpp's own plain greedy decoding (llama-cpp-python's `Llama.generate`).
- The text side: a GGUF's own vocabulary encodes and decodes like the tokenizer.json it came from.
The exactness suite (joint chi-square) with llama.cpp as target and as draft is in
tests/test_exactness.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.config import SamplingParams
from verispec.drafters.model import ModelDrafter
from verispec.engine import generate_all
from verispec.llamacpp import GGUFTokenizer, LlamaCppModel, unavailable
from verispec.llamacpp.lib import library
from verispec.models.checkpoint import CheckpointError, load_pretrained, load_tokenizer
from verispec.models.gguf_convert import cached_gguf, convert
from verispec.models.toy import make_toy_pair
from verispec.pair import DRAFT_DIR, TARGET_DIR
from verispec.sampling import RowSampling


def test_llama_cpp_runs_here():
    assert unavailable() is None  # CI installs llama-cpp-python: these tests must run, not skip


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """(HF directory, GGUF file) of the tiny random toy target (vocab 257)."""
    directory = tmp_path_factory.mktemp("toy")
    target_dir, _ = make_toy_pair(directory)
    return target_dir, convert(target_dir, directory / "target.gguf", "f32")


@pytest.fixture(scope="module")
def toy_model(toy):
    return LlamaCppModel(toy[1], n_threads=1)


@pytest.fixture(scope="module")
def toy_model_f32_kv(toy):
    return LlamaCppModel(toy[1], n_threads=1, kv_type="f32")


def _fresh(model, prompts: list[list[int]], new: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(len(prompts), 64)
    model.prefill(prompts, cache)
    return model(new, cache)


def test_forward_after_rollback_equals_a_fresh_prefill(toy_model):
    prompts = [[5, 9, 200, 31, 7], [44, 3], [101, 102, 103, 104, 105, 106, 107]]
    cache = toy_model.new_cache(3, 64)
    toy_model.prefill(prompts, cache)
    proposed = torch.tensor([[1, 2, 3, 4], [10, 20, 30, 40], [60, 61, 62, 63]])
    toy_model(proposed, cache)
    assert cache.host_lengths == [9, 6, 11]
    kept = [1, 4, 0]  # per row: how many of the 4 proposals survive
    cache.rollback([len(p) + n for p, n in zip(prompts, kept)])
    nxt = torch.tensor([[77, 78], [79, 80], [81, 82]])
    after_rollback = toy_model(nxt, cache)
    committed = [p + proposed[row, :n].tolist() for row, (p, n) in enumerate(zip(prompts, kept))]
    assert torch.allclose(after_rollback, _fresh(toy_model, committed, nxt), atol=1e-5, rtol=0)


def test_rows_of_a_batch_are_independent(toy_model):
    """A row's logits do not depend on the other rows, up to rounding: llama.cpp's default f16
    KV cache and its batched kernels round a little differently for other batch shapes (1e-4
    here), never by a row's contents."""
    prompts = [[5, 9, 200], [44, 3, 8, 8, 1, 2], [7]]
    new = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    batched = _fresh(toy_model, prompts, new)
    other = _fresh(
        toy_model,
        [[9, 9, 9, 9, 9, 9, 9, 9]] + prompts[1:],
        torch.tensor([[200, 201, 202]]).expand(1, 3).clone().repeat(3, 1),
    )
    assert not torch.allclose(batched[0], other[0], atol=1e-2)  # the check below can fail: row 0 differs here
    for row, prompt in enumerate(prompts):
        alone = _fresh(toy_model, [prompt], new[row : row + 1])[0]
        assert torch.allclose(batched[row], alone, atol=1e-3, rtol=0)
        assert torch.equal(batched[row].argmax(-1), alone.argmax(-1))


def test_rows_on_sequences_out_of_order_give_each_row_its_own_results(toy_model):
    """Rows whose llama.cpp sequences are not in rising order (as after rows leave and others
    join) are decoded sorted by sequence (one ubatch, `_by_sequence`) and their results put back
    in row order: logits, argmax and a draft's greedy continuation (logits at some positions
    only) equal those of the same rows on sequences 0, 1, 2. The prompts differ, so a result
    left in sequence order would land on the wrong row."""
    from verispec.llamacpp.context import _by_sequence

    assert _by_sequence(np.array([0, 0, 1, 2])) is None
    assert _by_sequence(np.array([2, 2, 0, 1, 0])).tolist() == [
        2,
        4,
        3,
        0,
        1,
    ]  # stable: a row's positions keep their order
    prompts = [[5, 9, 200, 31, 7], [44, 3], [101, 102, 103, 104]]
    new = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    results = []
    for seqs in ([0, 1, 2], [2, 0, 1]):
        cache = toy_model.new_cache(3, 64)
        cache.seqs = list(seqs)
        toy_model.prefill(prompts, cache)
        logits = toy_model(new, cache)
        argmax = toy_model.forward_argmax(new[:, :1], cache)
        drafted = toy_model.greedy_continuation(new, [1, 3, 2], 3, cache)
        results.append((logits, argmax, drafted))
    (logits, argmax, drafted), (logits2, argmax2, drafted2) = results
    assert not torch.allclose(logits[0], logits[1], atol=1e-2)
    assert torch.allclose(logits, logits2, atol=1e-3, rtol=0) and torch.equal(logits.argmax(-1), logits2.argmax(-1))
    assert torch.equal(argmax, argmax2) and torch.equal(drafted, drafted2)


def test_rows_with_gaps_between_their_sequences_leave_the_gaps_as_they_were(toy_model):
    """Rows on sequences 0, 2 and 5 (rows 1, 3 and 4 left; sequence 3 holds a prompt being
    read): each missing sequence gets as many placeholder tokens as a row has (3) after its
    last cell, so that llama.cpp runs one ubatch instead of one per run of consecutive ids and
    token (`_fill_gaps`). The rows' logits equal those on sequences 0, 1, 2, and the
    placeholders' cells are gone after the pass: every missing sequence ends where it did."""
    prompts = [[5, 9, 200, 31, 7], [44, 3], [101, 102, 103, 104]]
    new = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    plain = toy_model.new_cache(3, 64)
    toy_model.prefill(prompts, plain)
    expected = toy_model(new, plain)
    cache = toy_model.new_cache(6, 64)
    toy_model.prefill([prompts[0], [8], prompts[1], [9], [10], prompts[2]], cache)
    cache.keep_rows([0, 2, 5])
    context = cache.context
    context.decode(np.array([11, 12, 13]), np.arange(3), np.array([3, 3, 3]), False)
    lengths = np.repeat([len(p) for p in prompts], 3) + np.tile(np.arange(3), 3)
    gaps, positions = context._fill_gaps(np.repeat([0, 2, 5], 3), lengths)
    assert gaps.tolist() == [1, 1, 1, 3, 3, 3, 4, 4, 4] and positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    pads, at = context._fill_gaps(np.array([2, 3, 3, 4]), np.array([5, 5, 6, 5]))  # 1, 2 and 1 tokens: padded to 2 each
    assert pads.tolist() == [2, 4] and at.tolist() == [6, 6]
    assert (
        context._fill_gaps(np.array([2, 3, 4]), np.array([5, 5, 5])) is None
        and context._fill_gaps(np.array([1]), np.array([0])) is None
    )
    assert (
        context._fill_gaps(np.repeat([0, 2], [30, 4]), np.r_[np.arange(30), np.arange(4)]) is None
    )  # two prompts: padding would not pay
    assert torch.allclose(toy_model(new, cache), expected, atol=1e-3, rtol=0)
    last = [library().llama_memory_seq_pos_max(context.memory, seq) for seq in (1, 3, 4)]
    assert last == [-1, 2, -1]


def test_ubatches_count_as_llama_cpps_split_equal():
    """Runs of consecutive sequences with tokens, each ubatch the fewest tokens any has left."""
    from verispec.llamacpp.context import _ubatches

    assert _ubatches(np.array([2, 2, 2]), 512) == 1
    assert _ubatches(np.array([2, 1, 2]), 512) == 3  # one token from each, then sequences 0 and 2 apart: one each
    assert _ubatches(np.array([3, 0, 3, 3]), 512) == 2
    assert _ubatches(np.array([1, 2, 3]), 512) == 3
    assert _ubatches(np.array([100, 100]), 64) == 4  # 32 tokens of each per ubatch of 64


def test_rows_with_unequal_tokens_and_a_gap_decode_as_alone(toy_model):
    """A draft's pass where rows have 1 and 2 pending tokens and a sequence between them is
    free: padded to 2 tokens on every sequence, its logits at each row's last token equal the
    rows decoded one by one, and every sequence ends where its tokens end."""
    prompts = [[5, 9, 200, 31, 7], [44, 3], [101, 102, 103, 104]]
    cache = toy_model.new_cache(4, 64)
    toy_model.prefill([prompts[0], [8], prompts[1], prompts[2]], cache)
    cache.keep_rows([0, 2, 3])  # sequence 1 is free
    ids = torch.tensor([[1, 2], [4, 0], [7, 8]])
    drafted = toy_model.greedy_continuation(ids, [2, 1, 2], 3, cache)
    for row, (prompt, count) in enumerate(zip(prompts, [2, 1, 2])):
        alone = toy_model.new_cache(1, 64)
        toy_model.prefill([prompt], alone)
        assert torch.equal(
            drafted[row], toy_model.greedy_continuation(ids[row : row + 1, :count], [count], 3, alone)[0]
        )
    ends = [library().llama_memory_seq_pos_max(cache.context.memory, seq) + 1 for seq in (0, 1, 2, 3)]
    assert ends == [5 + 2 + 2, 0, 2 + 1 + 2, 4 + 2 + 2] == [cache.host_lengths[0], 0, *cache.host_lengths[1:]]


def test_logits_equal_the_pytorch_model_on_the_same_weights(toy, toy_model, toy_model_f32_kv):
    ids = torch.tensor([[5, 9, 200, 31, 7, 44, 3, 8, 250, 0, 12]])
    with torch.no_grad():
        expected = load_pretrained(toy[0])(ids)
    exact, rounded = toy_model_f32_kv(ids), toy_model(ids)  # no cache: the whole sequence from position 0
    assert exact.shape == expected.shape
    assert (exact - expected).abs().max() < 1e-4  # f32 weights, f32 KV cache: float rounding only
    assert 1e-4 < (rounded - expected).abs().max() < 1e-2  # llama.cpp's default f16 KV cache rounds keys and values
    assert torch.equal(exact.argmax(-1), expected.argmax(-1))


def test_forward_argmax_gives_the_argmax_of_forward(toy_model):
    prompts = [[5, 9, 200, 31, 7], [44, 3], [101, 102, 103]]
    new = torch.tensor([[1, 2, 3], [10, 20, 30], [60, 61, 62]])
    cache = toy_model.new_cache(3, 64)
    toy_model.prefill(prompts, cache)
    ids = toy_model.forward_argmax(new, cache)
    assert ids.dtype == torch.long and cache.host_lengths == [8, 5, 6]
    assert torch.equal(ids, _fresh(toy_model, prompts, new).argmax(-1))


def _greedy_loop(model, prompt: list[int], pending: list[int], steps: int) -> tuple[list[int], list[float]]:
    """The reference: feed the pending tokens, then argmax and feed, one forward at a time."""
    cache = model.new_cache(1, 64)
    model.prefill([prompt], cache)
    logits, tokens, confidence = model(torch.tensor([pending]), cache)[0, -1], [], []
    for step in range(steps):
        tokens.append(int(logits.argmax()))
        confidence.append(float(torch.softmax(logits, -1).max()))
        if step + 1 < steps:
            logits = model(torch.tensor([[tokens[-1]]]), cache)[0, -1]
    return tokens, confidence


def test_greedy_continuation_equals_the_forward_and_argmax_loop(toy_model):
    """Ragged pending tokens per row (as a draft after a full acceptance: two), k steps in one
    call: the loop's tokens, and a cache that holds exactly what the loop fed."""
    prompts, pending = [[5, 9, 200, 31], [44, 3], [7]], [[7], [8, 250], [12]]
    cache = toy_model.new_cache(3, 64)
    toy_model.prefill(prompts, cache)
    padded = torch.tensor([p + [0] * (2 - len(p)) for p in pending])
    drafted = toy_model.greedy_continuation(padded, [len(p) for p in pending], 4, cache)
    assert drafted.shape == (3, 4)
    for row, (prompt, tokens) in enumerate(zip(prompts, pending)):
        assert drafted[row].tolist() == _greedy_loop(toy_model, prompt, tokens, 4)[0]
    fed = [prompt + tokens + drafted[row, :3].tolist() for row, (prompt, tokens) in enumerate(zip(prompts, pending))]
    assert cache.host_lengths == [len(f) for f in fed]
    nxt = torch.tensor([[1], [2], [3]])
    assert torch.allclose(
        toy_model(nxt, cache), _fresh(toy_model, fed, nxt), atol=1e-3, rtol=0
    )  # 2e-4 apart on an AVX2-only machine (other ubatch shapes)


def test_greedy_continuation_stops_after_the_first_unsure_token(toy_model):
    prompt, pending = [5, 9, 200, 31], [7]
    tokens, confidence = _greedy_loop(toy_model, prompt, pending, 6)
    threshold = sorted(confidence)[2]  # two steps fall below it: the first of them ends the draft
    stop = next(i for i, c in enumerate(confidence) if c < threshold)
    cache = toy_model.new_cache(1, 64)
    toy_model.prefill([prompt], cache)
    drafted = toy_model.greedy_continuation(torch.tensor([pending]), [1], 6, cache, confidence_threshold=threshold)
    assert drafted[0].tolist() == tokens[: stop + 1]
    assert cache.host_lengths == [len(prompt) + 1 + stop]


def test_a_confident_draft_stops_at_the_same_place_on_both_backends(toy, toy_model_f32_kv):
    """ModelDrafter's confidence stop: llama.cpp's greedy_continuation and the PyTorch loop
    (the same weights) propose the same tokens, stopping at the same step."""
    from verispec.models.checkpoint import load_pretrained

    prompt = [5, 9, 200, 31, 7]
    confidence = _greedy_loop(toy_model_f32_kv, prompt[:-1], prompt[-1:], 6)[1]
    low, high = sorted(confidence)[2:4]
    threshold = (low + high) / 2  # far from every step's confidence
    params = SamplingParams(temperature=0, max_new_tokens=8)
    proposals = []
    for model in (toy_model_f32_kv, load_pretrained(toy[0])):
        drafter = ModelDrafter(model, confidence_threshold=threshold)
        drafter.start([prompt], 64)
        proposals.append(drafter.propose(6, RowSampling(params, 1))[0].tolist())
    assert proposals[0] == proposals[1]
    assert 1 <= len(proposals[0][0]) < 6


def test_a_cache_too_large_a_batch_or_a_missing_file_is_a_clear_error(toy_model, tmp_path):
    cache = toy_model.new_cache(1, 8)
    toy_model.prefill([[1, 2, 3, 4, 5, 6]], cache)
    with pytest.raises(ValueError, match="overflow"):
        toy_model(torch.tensor([[1, 2, 3]]), cache)
    with pytest.raises(ValueError, match="sequences"):
        toy_model.new_cache(257, 8)
    with pytest.raises(CheckpointError, match="no such GGUF"):
        LlamaCppModel(tmp_path / "absent.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(CheckpointError, match="truncated: 15 bytes end inside the GGUF header"):
        LlamaCppModel(bad)


@pytest.fixture(scope="module")
def pair():
    return LlamaCppModel(cached_gguf(TARGET_DIR, "f32")), LlamaCppModel(cached_gguf(DRAFT_DIR, "f32"))


PROMPTS = ["def quicksort(arr):\n", "class Stack:\n    def __init__(self):", "import os\n\ndef walk(path):"]


def test_greedy_speculative_equals_llama_cpp_plain_greedy(pair):
    from llama_cpp import Llama

    target, draft = pair
    tokenizer = GGUFTokenizer(target)
    llm = Llama(model_path=str(target.path), n_ctx=256, n_threads=2, verbose=False)
    params = SamplingParams(temperature=0, max_new_tokens=40)
    for text in PROMPTS:
        prompt = tokenizer.encode(text).ids
        expected = []
        for token in llm.generate(prompt, temp=0.0, reset=True):
            expected.append(int(token))
            if len(expected) == params.max_new_tokens:
                break
        llm.reset()
        for k in (1, 4):
            assert generate_all(target, [prompt], params, ModelDrafter(draft), k=k)[0] == expected, (text, k)
    batched = generate_all(target, [tokenizer.encode(t).ids for t in PROMPTS], params, ModelDrafter(draft), k=3)
    assert batched == [generate_all(target, [tokenizer.encode(t).ids], params)[0] for t in PROMPTS]


TEXTS = [
    "def f(x):\n    return x  # comment\n\n",
    "  indented\ttabs\r\nCRLF",
    "unicode: é ü ß 中文 🙂",
    "<|endoftext|>after",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_the_gguf_vocabulary_encodes_and_decodes_like_tokenizer_json(pair, text):
    tokenizer, reference = GGUFTokenizer(pair[0]), load_tokenizer(TARGET_DIR)
    ids = tokenizer.encode(text).ids
    assert ids == reference.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_a_forward_larger_than_one_llama_cpp_batch_is_split(toy_model):
    """2 rows x 300 tokens go as several llama_decode calls (at most 512 tokens each, fewer in
    a small context), with the same logits as row by row."""
    ids = torch.randint(0, 257, (2, 300), generator=torch.Generator().manual_seed(0))
    cache = toy_model.new_cache(2, 300)
    assert cache.context.n_batch < ids.numel()
    together = toy_model(ids, cache)
    for row in range(2):
        alone = toy_model(ids[row : row + 1])[0]
        assert torch.allclose(together[row], alone, atol=1e-3, rtol=0)


def test_the_backend_is_chosen_by_format_and_name(toy, tmp_path):
    from verispec.models.backend import load
    from verispec.models.llama import LlamaForCausalLM

    directory, gguf = toy
    assert isinstance(load(gguf)[0], LlamaCppModel) and isinstance(
        load(directory)[0], LlamaCppModel
    )  # auto: llama.cpp runs here
    assert isinstance(load(directory, "torch")[0], LlamaForCausalLM)
    with pytest.raises(CheckpointError, match="runs on llama.cpp"):
        load(gguf, "torch")
    with pytest.raises(ValueError, match="--backend"):
        load(directory, "onnx")
    with pytest.raises(ValueError, match="--gguf-type"):
        load(directory, "llamacpp", gguf_type="q9_k")


def test_auto_falls_back_to_torch_with_a_reason_and_llamacpp_refuses(tmp_path):
    """A model llama.cpp cannot take from a directory (not Llama-family: GPT-2 here)."""
    transformers = pytest.importorskip("transformers")
    from verispec.models.backend import load
    from verispec.models.hf import HFCausalLM

    config = transformers.GPT2Config(vocab_size=16, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    model, note = load(tmp_path / "gpt2")
    assert isinstance(model, HFCausalLM) and note.startswith("using the torch backend") and "\n" not in note
    with pytest.raises(CheckpointError, match="gpt2"):
        load(tmp_path / "gpt2", "llamacpp")


def test_generate_from_the_command_line_with_gguf_target_and_draft(toy, tmp_path, capsys):
    from verispec.cli import main

    directory, gguf = toy
    draft = convert(directory.parent / "draft", tmp_path / "draft.gguf", "f32")
    common = ["generate", "def f(x):", "--max-new-tokens", "12", "--ignore-eos", "--k", "3"]
    assert main(common + ["--target", str(gguf), "--draft", str(draft)]) == 0
    on_gguf = capsys.readouterr().out.splitlines()
    assert (
        main(common + ["--target", str(directory), "--draft", str(directory.parent / "draft")]) == 0
    )  # converted, cached
    on_directories = capsys.readouterr().out.splitlines()
    assert on_gguf[:-1] == on_directories[:-1] and "alpha_hat" in on_gguf[-1]
    assert main(common + ["--target", str(gguf), "--draft", str(directory.parent / "draft")]) == 0  # mixed formats
    assert main(common + ["--target", str(gguf), "--backend", "torch"]) == 2
    assert "runs on llama.cpp" in capsys.readouterr().err


def test_the_description_counts_the_files_parameters(tmp_path):
    """llama.cpp's own size label guesses a family's size from the layer count ("256M" for a 135M
    SmolLM2, "?B" for the built-in pair): the statistics line gives the count of the file's weights."""
    from verispec.models.gguf_header import tensor_table

    path = convert(DRAFT_DIR, tmp_path / "draft.gguf", "q8_0")
    model = LlamaCppModel(path)
    weights = sum(int(np.prod(t.shape)) for t in tensor_table(path))
    arch, size, *type_name = model.config.description.split(" ")
    assert arch == "llama" and type_name and "?" not in size
    assert size == f"{weights / 1e6:.0f}M", (size, weights)


def test_a_measurement_made_once_is_said_once(monkeypatch, tmp_path, capsys):
    from verispec.llamacpp import memo

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    calls = []
    first = memo.remembered("probe", ["file", 1], lambda: calls.append(1) or {"x": 1}, "the probe of file")
    assert first == {"x": 1} and "verispec: measuring the probe of file (once" in capsys.readouterr().err
    assert memo.remembered("probe", ["file", 1], lambda: calls.append(1) or {"x": 2}) == {"x": 1} and calls == [1]
    assert not capsys.readouterr().err  # remembered: nothing to wait for, nothing said
