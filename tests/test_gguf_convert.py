"""models/gguf_convert.py: Hugging Face directory -> GGUF.

The conversion tests read files back with `gguf.GGUFReader` and need no llama.cpp. The tests in
`TestLlamaCpp` load the files in llama.cpp (llama-cpp-python; skipped without it) and compare
its tokenization with the `tokenizers` library's and its logits and greedy continuations with
verispec's PyTorch model on the same directory; one negative control (q/k rows left
unpermuted) shows that the logit comparison sees the RoPE layout.
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")  # the converter's writer; llama.cpp itself is needed only by TestLlamaCpp

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFReader, TokenType, quants

from verispec import SamplingParams, generate_all
from verispec.models.checkpoint import (
    CheckpointError,
    _read_state_dict,
    load_pretrained,
    load_tokenizer,
    save_pretrained,
)
from verispec.models.gguf_convert import _permute, cached_gguf, convert, gguf_vocab
from verispec.models.kernels import cache_root
from verispec.models.llama import LlamaConfig, LlamaForCausalLM, init_weights
from verispec.models.toy import byte_level_tokenizer, make_toy_pair
from verispec.pair import DRAFT_DIR

TEXTS = [
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n\tpivot = arr[0]  # tab\n",
    "Ünïcödé: naïve café, Ελληνικά, русский, 中文字符, हिन्दी",
    "emoji 🚀🦙 and ZWJ 😶\u200d🌫️ ✅",
    "\n\n\n   \n  trailing spaces   \r\n\r\nCRLF",
    "I've been 'told he's there, 'RE you sure? We'Ve a'lL 3 33 333 3333 3.14 1e-9",
    "------======= '''```\"\"\"......!!!!!!?????? x<y>=z ~^|",
    "",
    " ",
]
SPECIAL_TEXT = "first<|endoftext|>second"  # tokenizers always matches added tokens in text


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_pair(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def draft_f32(tmp_path_factory):
    return convert(DRAFT_DIR, tmp_path_factory.mktemp("draft") / "draft.gguf")


def tiny_dir(path, tokenizer=None, seed=0, bias_std=0.0, **changes):
    """A random tiny Llama-family directory; `changes` override the config, biases ~ N(0, bias_std)."""
    fields = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        eos_token_id=None,
    )
    config = LlamaConfig(**{**fields, **changes})
    model = init_weights(LlamaForCausalLM(config), std=0.1, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * bias_std)
    save_pretrained(model, path)
    if tokenizer is not None:
        tokenizer.save(str(path / "tokenizer.json"))
    return path


def fields(path):
    return {
        name: field.contents() for name, field in GGUFReader(str(path)).fields.items() if not name.startswith("GGUF.")
    }


def tensors(path):
    return {t.name: t for t in GGUFReader(str(path)).tensors}


# --- conversion, read back with GGUFReader (no llama.cpp) -----------------------------------------


def test_toy_target_metadata_and_shapes(toy, tmp_path):
    target = toy[0]
    path = convert(target, tmp_path / "toy.gguf")
    meta, found = fields(path), tensors(path)
    config = load_pretrained(target).config
    expected_meta = {
        "general.architecture": "llama",
        "general.name": "target",
        "general.file_type": 0,
        "llama.context_length": config.max_position_embeddings,
        "llama.embedding_length": 128,
        "llama.block_count": 4,
        "llama.feed_forward_length": 384,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.attention.key_length": 32,
        "llama.attention.value_length": 32,
        "llama.rope.dimension_count": 32,
        "llama.vocab_size": 257,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.eos_token_id": 256,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
    }
    assert {k: meta[k] for k in expected_meta} == expected_meta
    assert meta["llama.rope.freq_base"] == pytest.approx(10000.0)
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    # GGUFReader shapes are ggml's: innermost (row length) first
    assert tuple(found["token_embd.weight"].shape) == (128, 257)
    assert "output.weight" not in found  # tied: llama.cpp reuses token_embd
    assert tuple(found["blk.3.attn_q.weight"].shape) == (128, 128)
    assert tuple(found["blk.3.attn_k.weight"].shape) == (128, 64)
    assert tuple(found["blk.0.ffn_down.weight"].shape) == (384, 128)
    assert tuple(found["output_norm.weight"].shape) == (128,)
    assert len(found) == 2 + 4 * 9
    assert {t.tensor_type for t in found.values()} == {Q.F32}


def test_weights_are_the_checkpoint_s_with_q_and_k_permuted(tmp_path):
    directory = tiny_dir(tmp_path / "m", bias_std=0.5, attention_bias=True)
    path = convert(directory, tmp_path / "m.gguf")
    state = {n: t.float().numpy() for n, t in _read_state_dict(directory).items()}
    found = {name: np.asarray(t.data).reshape(tuple(reversed(t.shape))) for name, t in tensors(path).items()}
    np.testing.assert_array_equal(
        found["blk.1.attn_q.weight"], _permute(state["model.layers.1.self_attn.q_proj.weight"], 4)
    )
    np.testing.assert_array_equal(
        found["blk.1.attn_k.weight"], _permute(state["model.layers.1.self_attn.k_proj.weight"], 2)
    )
    np.testing.assert_array_equal(
        found["blk.1.attn_k.bias"], _permute(state["model.layers.1.self_attn.k_proj.bias"], 2)
    )
    np.testing.assert_array_equal(found["blk.1.attn_v.weight"], state["model.layers.1.self_attn.v_proj.weight"])
    np.testing.assert_array_equal(found["output.weight"], state["lm_head.weight"])
    assert not np.array_equal(found["blk.1.attn_q.weight"], state["model.layers.1.self_attn.q_proj.weight"])


def test_permute_interleaves_the_two_halves_of_each_head():
    """Rotate-half pairs (i, i + d/2) become adjacent rows (2i, 2i + 1), head by head."""
    heads, d = 3, 8
    rows = np.arange(heads * d)[:, None] * np.ones((1, 5))
    permuted = _permute(rows, heads)[:, 0]
    expected = [h * d + i + half * d // 2 for h in range(heads) for i in range(d // 2) for half in (0, 1)]
    assert permuted.tolist() == expected


def test_qwen2_is_written_unpermuted_with_biases(tmp_path):
    directory = tiny_dir(tmp_path / "q", bias_std=0.5, model_type="qwen2", attention_bias=True)
    path = convert(directory, tmp_path / "q.gguf")
    state = {n: t.float().numpy() for n, t in _read_state_dict(directory).items()}
    found = {name: np.asarray(t.data).reshape(tuple(reversed(t.shape))) for name, t in tensors(path).items()}
    assert fields(path)["general.architecture"] == "qwen2"
    np.testing.assert_array_equal(found["blk.0.attn_q.weight"], state["model.layers.0.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(found["blk.0.attn_q.bias"], state["model.layers.0.self_attn.q_proj.bias"])
    assert {"blk.1.attn_k.bias", "blk.1.attn_v.bias"} <= set(found)


def test_builtin_draft_vocabulary_equals_the_tokenizer_s(draft_f32):
    tokenizer = load_tokenizer(DRAFT_DIR)
    vocab, special = gguf_vocab(draft_f32)
    assert vocab == tokenizer.get_vocab(with_added_tokens=True)
    assert special == {"<|endoftext|>"}
    meta = fields(draft_f32)
    assert meta["tokenizer.ggml.merges"][:2] == ["Ġ Ġ", "ĠĠ ĠĠ"]  # stored as pairs in tokenizer.json
    assert len(meta["tokenizer.ggml.merges"]) == len(
        json.loads((DRAFT_DIR / "tokenizer.json").read_text())["model"]["merges"]
    )
    assert meta["tokenizer.ggml.bos_token_id"] == meta["tokenizer.ggml.eos_token_id"] == 0  # no bos: GPT-2's bos = eos


def test_model_vocab_beyond_the_tokenizer_gets_unused_placeholders(tmp_path):
    directory = tiny_dir(tmp_path / "m", byte_level_tokenizer(), vocab_size=300, eos_token_id=256)
    path = convert(directory, tmp_path / "m.gguf")
    meta = fields(path)
    assert meta["tokenizer.ggml.tokens"][299] == "[PAD299]"
    assert meta["tokenizer.ggml.token_type"][299] == TokenType.UNUSED
    assert meta["tokenizer.ggml.token_type"][256] == TokenType.CONTROL
    assert gguf_vocab(path) == (byte_level_tokenizer().get_vocab(with_added_tokens=True), {"<|endoftext|>"})


def test_a_directory_without_tokenizer_gets_placeholder_tokens(tmp_path):
    directory = tiny_dir(tmp_path / "m", vocab_size=5)
    path = convert(directory, tmp_path / "m.gguf")
    meta = fields(path)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["llama.vocab_size"] == 5
    assert meta["tokenizer.ggml.tokens"] == [f"[PAD{i}]" for i in range(5)]
    assert meta["tokenizer.ggml.token_type"] == [TokenType.UNUSED] * 5
    assert gguf_vocab(path) == ({}, set())


@pytest.mark.parametrize("kind", ["f16", "bf16", "q8_0", "q4_0"])
def test_types_quantize_matrices_keep_norms_f32_and_fall_back_to_f16(kind, tmp_path):
    """hidden 48: rows of 48 values are not whole 32-blocks (q8_0/q4_0 fall back to f16); ffn_down's rows of 96 are."""
    directory = tiny_dir(tmp_path / "m", hidden_size=48, intermediate_size=96, head_dim=12)
    path = convert(directory, tmp_path / "m.gguf", kind)
    found = tensors(path)
    wanted = {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[kind]
    assert found["blk.0.ffn_down.weight"].tensor_type == wanted
    assert found["blk.0.attn_q.weight"].tensor_type == (Q.BF16 if kind == "bf16" else Q.F16)
    assert found["blk.0.attn_norm.weight"].tensor_type == found["output_norm.weight"].tensor_type == Q.F32
    assert fields(path)["general.file_type"] == {"f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2}[kind]
    tensor = found["blk.1.ffn_down.weight"]
    restored = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(48, 96)
    original = _read_state_dict(directory)["model.layers.1.mlp.down_proj.weight"].float().numpy()
    step = {"f16": 1e-3, "bf16": 1 / 128, "q8_0": 1 / 127, "q4_0": 1 / 7}[kind] * np.abs(original).max()
    assert np.abs(restored - original).max() <= step
    assert 0 < np.abs(restored - original).max() or kind == "f16"


def test_bf16_keeps_a_bfloat16_checkpoint_exact(tmp_path):
    found = tensors(convert(DRAFT_DIR, tmp_path / "d.gguf", "bf16"))
    tensor = found["blk.1.ffn_up.weight"]
    restored = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(768, 256)
    original = _read_state_dict(DRAFT_DIR)["model.layers.1.mlp.up_proj.weight"]
    assert original.dtype == torch.bfloat16
    np.testing.assert_array_equal(restored, original.float().numpy())


def test_q4_0_keeps_the_embedding_and_head_at_q8_0(toy, tmp_path):
    found = tensors(convert(toy[0], tmp_path / "t.gguf", "q4_0"))
    assert found["token_embd.weight"].tensor_type == Q.Q8_0
    assert found["blk.0.attn_q.weight"].tensor_type == Q.Q4_0


def test_cached_gguf_converts_once_per_weights_and_type(toy, tmp_path, monkeypatch):
    target = toy[0]
    first = cached_gguf(target, cache_dir=tmp_path / "cache")
    stamp = first.stat().st_mtime_ns
    assert cached_gguf(target, cache_dir=tmp_path / "cache") == first
    assert first.stat().st_mtime_ns == stamp
    other = cached_gguf(target, "q8_0", cache_dir=tmp_path / "cache")
    assert other != first and other.is_file()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [first.name, other.name]
    )  # no temp files left
    digest = first.name.rsplit("-", 2)[1]
    copy, changed = tmp_path / "copy", tmp_path / "changed"
    shutil.copytree(target, copy)
    shutil.copytree(target, changed)
    save_pretrained(init_weights(load_pretrained(target), std=0.1, seed=7), changed)
    assert cached_gguf(copy, cache_dir=tmp_path / "cache").name.rsplit("-", 2)[1] == digest  # keyed by contents
    assert cached_gguf(changed, cache_dir=tmp_path / "cache").name.rsplit("-", 2)[1] != digest
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("VERISPEC_CACHE", raising=False)
    assert cached_gguf(target).parent == tmp_path / "xdg" / "verispec" / "gguf"
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "one"))  # one variable for every cache, kernels' too
    assert cached_gguf(target).parent == tmp_path / "one" / "gguf" and cache_root() == tmp_path / "one" / "kernels"


def one_line_error(error_type, call):
    with pytest.raises(error_type) as info:
        call()
    assert "\n" not in str(info.value)
    return str(info.value)


def test_bad_inputs_are_refused_in_one_line(toy, tmp_path):
    target = toy[0]
    assert "config.json" in one_line_error(CheckpointError, lambda: convert(tmp_path, tmp_path / "x.gguf"))
    assert "q5_k" in one_line_error(ValueError, lambda: convert(target, tmp_path / "x.gguf", "q5_k"))
    assert "q5_k" in one_line_error(ValueError, lambda: cached_gguf(target, "q5_k", cache_dir=tmp_path))
    quantized = tmp_path / "quantized"
    shutil.copytree(target, quantized)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(
        json.dumps({**config, "quantization_config": {"quant_method": "verispec", "bits": 8}})
    )
    assert "--type" in one_line_error(CheckpointError, lambda: convert(quantized, tmp_path / "x.gguf"))
    assert not (tmp_path / "x.gguf").exists()


def test_unknown_pre_tokenizers_are_refused(toy, tmp_path):
    directory = tmp_path / "m"
    shutil.copytree(toy[0], directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    assert "Metaspace" in one_line_error(CheckpointError, lambda: convert(directory, tmp_path / "x.gguf"))
    spec["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    assert "add_prefix_space" in one_line_error(CheckpointError, lambda: convert(directory, tmp_path / "x.gguf"))
    assert os.listdir(tmp_path) == ["m"]


# --- llama.cpp -------------------------------------------------------------------------------------


def split_regex_tokenizer(pattern: str, ignore_merges: bool, corpus: list[str]):
    """A byte-level BPE with a Split pre-tokenizer (Llama 3 / Qwen2 style) trained on corpus, so
    that its merges cross every boundary the pre-tokenizer could get wrong."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus * 20, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp")


def llama(llama_cpp, path, vocab_only=False):
    from verispec.llamacpp.lib import library

    library()  # llama.cpp set up as verispec sets it up (llamacpp/lib.py: no AMX buffers where they fault)
    if vocab_only:
        return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=256,
        n_batch=256,
        logits_all=True,
        verbose=False,
        n_threads=1,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
    )


def llama_logits(model, tokens: list[int]) -> np.ndarray:
    model.reset()
    model.eval(tokens)
    return np.array(model.scores[: len(tokens)], dtype=np.float64)  # [T, V]


def llama_greedy(model, prompt: list[int], steps: int) -> list[int]:
    model.reset()
    model.eval(prompt)
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(model.scores[model.n_tokens - 1])))
        model.eval(out[-1:])
    return out


@torch.no_grad()
def torch_logits(directory, tokens: list[int]) -> np.ndarray:
    return load_pretrained(directory).forward(torch.tensor([tokens]))[0].double().numpy()  # [T, V]


def torch_greedy(directory, prompt: list[int], steps: int) -> list[int]:
    """verispec's plain greedy decoding (KV cache, no drafter), float32."""
    return generate_all(load_pretrained(directory), [prompt], SamplingParams(temperature=0, max_new_tokens=steps))[0]


@pytest.mark.usefixtures("one_thread")
class TestLlamaCpp:
    def test_tokenization_equals_the_tokenizers_library(self, llama_cpp, draft_f32, toy, tmp_path):
        toy_path = convert(toy[0], tmp_path / "toy.gguf")
        for directory, path in ((DRAFT_DIR, draft_f32), (toy[0], toy_path)):
            hf, model = load_tokenizer(directory), llama(llama_cpp, path, vocab_only=True)
            for text in TEXTS:
                ids = model.tokenize(text.encode(), add_bos=False, special=False)
                assert ids == hf.encode(text).ids, (directory, text)
                assert model.detokenize(ids).decode() == text
            assert model.tokenize(SPECIAL_TEXT.encode(), add_bos=False, special=True) == hf.encode(SPECIAL_TEXT).ids

    @pytest.mark.parametrize(
        "pattern, ignore_merges",
        [
            (
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| "
                r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
                True,
            ),
            (
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| "
                r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
                False,
            ),
        ],
        ids=["llama-bpe", "qwen2"],
    )
    def test_split_regex_pre_tokenizers_map_exactly(self, llama_cpp, pattern, ignore_merges, tmp_path):
        tokenizer = split_regex_tokenizer(pattern, ignore_merges, TEXTS + [SPECIAL_TEXT])
        directory = tiny_dir(tmp_path / "m", tokenizer, vocab_size=tokenizer.get_vocab_size())
        model = llama(llama_cpp, convert(directory, tmp_path / "m.gguf"), vocab_only=True)
        for text in TEXTS + ["We'VE 12345678 'Ll\n\n  x"]:
            assert model.tokenize(text.encode(), add_bos=False, special=False) == tokenizer.encode(text).ids, text

    @pytest.mark.parametrize("which", ["toy target", "built-in draft"])
    def test_logits_and_greedy_continuation_equal_verispec_s(self, llama_cpp, which, toy, draft_f32, tmp_path):
        directory, path = (
            (toy[0], convert(toy[0], tmp_path / "t.gguf")) if which == "toy target" else (DRAFT_DIR, draft_f32)
        )
        prompt = load_tokenizer(directory).encode(TEXTS[0] + TEXTS[1]).ids
        model = llama(llama_cpp, path)
        expected = torch_logits(directory, prompt)
        assert np.abs(llama_logits(model, prompt) - expected).max() < 1e-3 * max(1.0, np.abs(expected).max())
        assert llama_greedy(model, prompt, 24) == torch_greedy(directory, prompt, 24)

    @pytest.mark.parametrize("which", ["toy target", "built-in draft"])
    def test_greedy_continuation_equals_transformers(self, llama_cpp, which, toy, draft_f32, tmp_path):
        """The converted f32 file on llama.cpp continues as transformers does on the directory."""
        transformers = pytest.importorskip("transformers")
        directory, path = (
            (toy[0], convert(toy[0], tmp_path / "t.gguf")) if which == "toy target" else (DRAFT_DIR, draft_f32)
        )
        prompt = load_tokenizer(directory).encode(TEXTS[0] + TEXTS[1]).ids
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
        with torch.no_grad():
            ids = torch.tensor([prompt])
            expected = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )[0, len(prompt) :].tolist()
        assert llama_greedy(llama(llama_cpp, path), prompt, 24) == expected

    def test_unpermuted_q_and_k_give_other_logits(self, llama_cpp, draft_f32, tmp_path):
        """Negative control: the comparison above sees the RoPE layout."""
        prompt = load_tokenizer(DRAFT_DIR).encode(TEXTS[0]).ids
        wrong = llama_logits(llama(llama_cpp, convert(DRAFT_DIR, tmp_path / "w.gguf", _permute_qk=False)), prompt)
        right = llama_logits(llama(llama_cpp, draft_f32), prompt)
        assert np.abs(wrong - right)[1:].max() > 0.1  # position 0 attends only to itself: RoPE cancels
        np.testing.assert_allclose(wrong[0], right[0], atol=1e-3)

    @pytest.mark.parametrize(
        "changes",
        [
            dict(model_type="qwen2", attention_bias=True),
            dict(attention_bias=True),
            dict(vocab_size=5, num_attention_heads=4, num_key_value_heads=4),
        ],
        ids=["qwen2", "llama-bias", "vocab5-no-tokenizer"],
    )
    def test_tiny_architectures_match(self, llama_cpp, changes, tmp_path):
        directory = tiny_dir(tmp_path / "m", bias_std=0.5, **changes)
        tokens = [i % changes.get("vocab_size", 64) for i in range(3, 40, 3)]
        got = llama_logits(llama(llama_cpp, convert(directory, tmp_path / "m.gguf")), tokens)
        np.testing.assert_allclose(got, torch_logits(directory, tokens), atol=1e-3)

    def test_a_file_without_vocabulary_generates_and_tokenizes_text_to_nothing(self, llama_cpp, tmp_path):
        model = llama(llama_cpp, convert(tiny_dir(tmp_path / "m", vocab_size=5), tmp_path / "m.gguf"))
        assert model.tokenize(b"any text\n", add_bos=False, special=True) == []  # llama.cpp's "none" model aborts here
        assert model.detokenize([1, 2]) == b""
        assert llama_greedy(model, [1, 2, 3], 4) == torch_greedy(tmp_path / "m", [1, 2, 3], 4)

    @pytest.mark.parametrize(
        "kind, agreement, correlation",
        [("f16", 0.95, 0.9999), ("bf16", 0.95, 0.9999), ("q8_0", 0.9, 0.999), ("q4_0", 0.7, 0.97)],
    )
    def test_quantized_files_load_and_stay_close(self, llama_cpp, kind, agreement, correlation, draft_f32, tmp_path):
        tokens = load_tokenizer(DRAFT_DIR).encode("".join(TEXTS[:2]) * 2).ids[:128]
        exact = llama_logits(llama(llama_cpp, draft_f32), tokens)
        approx = llama_logits(llama(llama_cpp, convert(DRAFT_DIR, tmp_path / f"{kind}.gguf", kind)), tokens)
        assert (exact.argmax(-1) == approx.argmax(-1)).mean() >= agreement
        assert np.corrcoef(exact.ravel(), approx.ravel())[0, 1] >= correlation
