"""Tiny GGUF files of the architectures users run, written with the `gguf` package (random weights).

`write(arch, path, tokenizer_file)` copies the tokenizer metadata of a GGUF verispec converted (a
byte-level vocabulary) and writes an architecture's own hyperparameters and tensors as llama.cpp's
loader names them (src/llama-model.cpp): `llama` (with `add_bos_token`: a Llama 3 / Mistral-style
file), `qwen2` (q/k/v biases), `qwen3` (per-head q/k norms), `gemma3` (sliding-window layers, a window
of `WINDOW` positions, with one global layer in six; norms after attention and the MLP), `phi3` (fused
qkv and gate-up) and `mamba` (recurrent: its state cannot be rolled back one position at a time).
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

WIDTH, FF, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 96, 4, 2, 16, 2
WINDOW = 8  # gemma3's sliding window: shorter than the tests' contexts, so that it moves during a run
ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "phi3", "mamba")


def _tokenizer_fields(source: str) -> list[tuple[str, GGUFValueType, object, GGUFValueType | None]]:
    """(key, type, value, array item type) of every tokenizer.* field of a GGUF file."""
    found = []
    for name, field in GGUFReader(source).fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        item = field.types[-1] if kind == GGUFValueType.ARRAY else None
        found.append((name, kind, field.contents(), item))
    return found


def _attention(tensors: dict, i: int, rng, q_out: int, kv_out: int) -> None:
    tensors[f"blk.{i}.attn_q.weight"] = rng(q_out, WIDTH)
    tensors[f"blk.{i}.attn_k.weight"] = rng(kv_out, WIDTH)
    tensors[f"blk.{i}.attn_v.weight"] = rng(kv_out, WIDTH)
    tensors[f"blk.{i}.attn_output.weight"] = rng(WIDTH, q_out)


def _tensors(arch: str, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Random weights in llama.cpp's names, each shaped as numpy (rows, columns) = (ne1, ne0)."""
    generator = np.random.default_rng(seed)

    def rng(*shape: int, scale: float = 0.15) -> np.ndarray:
        return (generator.standard_normal(shape) * scale).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return (1.0 + generator.standard_normal(n) * 0.05).astype(np.float32)

    q_out, kv_out = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    tensors = {"token_embd.weight": rng(vocab, WIDTH, scale=0.5), "output_norm.weight": ones(WIDTH)}
    tensors["output.weight"] = rng(vocab, WIDTH, scale=1.0)
    for i in range(LAYERS):
        if arch == "mamba":
            inner, state, rank, conv = 2 * WIDTH, 4, 4, 4
            tensors[f"blk.{i}.attn_norm.weight"] = ones(WIDTH)
            tensors[f"blk.{i}.ssm_in.weight"] = rng(2 * inner, WIDTH)
            tensors[f"blk.{i}.ssm_conv1d.weight"] = rng(inner, conv)
            tensors[f"blk.{i}.ssm_conv1d.bias"] = rng(inner)
            tensors[f"blk.{i}.ssm_x.weight"] = rng(rank + 2 * state, inner)
            tensors[f"blk.{i}.ssm_dt.weight"] = rng(inner, rank)
            tensors[f"blk.{i}.ssm_dt.bias"] = rng(inner)
            tensors[f"blk.{i}.ssm_a"] = -np.exp(rng(inner, state))
            tensors[f"blk.{i}.ssm_d"] = ones(inner)
            tensors[f"blk.{i}.ssm_out.weight"] = rng(WIDTH, inner)
            continue
        tensors[f"blk.{i}.attn_norm.weight"] = ones(WIDTH)
        tensors[f"blk.{i}.ffn_norm.weight"] = ones(WIDTH)
        tensors[f"blk.{i}.ffn_down.weight"] = rng(WIDTH, FF)
        if arch == "phi3":
            tensors[f"blk.{i}.attn_qkv.weight"] = rng(q_out + 2 * kv_out, WIDTH)
            tensors[f"blk.{i}.attn_output.weight"] = rng(WIDTH, q_out)
            tensors[f"blk.{i}.ffn_up.weight"] = rng(2 * FF, WIDTH)  # gate and up, fused
            continue
        _attention(tensors, i, rng, q_out, kv_out)
        tensors[f"blk.{i}.ffn_gate.weight"] = rng(FF, WIDTH)
        tensors[f"blk.{i}.ffn_up.weight"] = rng(FF, WIDTH)
        if arch == "qwen2":
            for name, size in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                tensors[f"blk.{i}.attn_{name}.bias"] = rng(size)
        if arch in ("qwen3", "gemma3"):
            tensors[f"blk.{i}.attn_q_norm.weight"] = ones(HEAD_DIM)
            tensors[f"blk.{i}.attn_k_norm.weight"] = ones(HEAD_DIM)
        if arch == "gemma3":
            tensors[f"blk.{i}.post_attention_norm.weight"] = ones(WIDTH)
            tensors[f"blk.{i}.post_ffw_norm.weight"] = ones(WIDTH)
    return tensors


def write(arch: str, path, tokenizer_file, seed: int = 0, add_bos: bool | None = None, context: int = 512):
    """A tiny `arch` GGUF at `path` with the vocabulary of `tokenizer_file` (a GGUF); returns path."""
    fields = _tokenizer_fields(str(tokenizer_file))
    vocab = next(len(value) for key, _, value, _ in fields if key == "tokenizer.ggml.tokens")
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")  # not "phi3": llama.cpp then asks for Phi-3's own special tokens
    writer.add_context_length(context)
    writer.add_embedding_length(WIDTH)
    writer.add_block_count(LAYERS)
    writer.add_layer_norm_rms_eps(1e-5)
    if arch == "mamba":
        writer.add_ssm_conv_kernel(4)
        writer.add_ssm_inner_size(2 * WIDTH)
        writer.add_ssm_state_size(4)
        writer.add_ssm_time_step_rank(4)
        writer.add_feed_forward_length(0)
        writer.add_head_count(0)
    else:
        writer.add_feed_forward_length(FF)
        writer.add_head_count(HEADS)
        writer.add_head_count_kv(KV_HEADS)
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
        writer.add_rope_freq_base(10000.0)
        writer.add_rope_dimension_count(HEAD_DIM)
    if arch == "gemma3":
        writer.add_sliding_window(WINDOW)
    for key, kind, value, item in fields:
        if key == "tokenizer.ggml.add_bos_token" and add_bos is not None:
            continue
        if kind == GGUFValueType.ARRAY:
            writer.add_array(key, value) if item != GGUFValueType.STRING else writer.add_array(key, list(value))
        else:
            writer.add_key_value(key, value, kind)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    for name, tensor in _tensors(arch, vocab, seed).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
