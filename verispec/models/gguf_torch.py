"""A Llama-architecture GGUF file read into verispec's PyTorch Llama (dequantized to float).

Owns `read_gguf_weights` (config and Hugging Face-named float tensors, optionally only the first
layers) and `load_gguf_torch` (the model). It is how `verispec train draft --target FILE.gguf`
starts a draft from the target's own embedding, first layers and head, and how a trained
draft whose GGUF has a vocabulary subset runs (`verispec.draft.vocab_ids`, see
training/draft_head.py). The inverse of gguf_convert: llama.cpp's interleaved RoPE rows are put
back in rotate-half order. Knows nothing of decoding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .checkpoint import CheckpointError
from .gguf_convert import _LAYER_NAMES
from .llama import LlamaConfig, LlamaForCausalLM, from_hf_state_dict

_HF_NAMES = {gguf: hf for hf, gguf in _LAYER_NAMES.items()}  # "attn_q" -> "self_attn.q_proj", ...


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None or not field.data:
        return default
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode()
    return value.tolist()[0] if hasattr(value, "tolist") else value


def gguf_config(reader, path: str | Path) -> LlamaConfig:
    """The LlamaConfig a llama-architecture file describes; CheckpointError for any other."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: architecture {arch!r}; a draft is trained for llama-architecture files only")
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    return LlamaConfig(
        vocab_size=int(embd.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.attention.key_length", hidden // heads)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's interleaved RoPE pairs -> rotate-half rows, per head (gguf_convert._permute inverted)."""
    shape = weights.shape
    return weights.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def read_gguf_weights(path: str | Path, num_layers: int | None = None) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """(config, float32 tensors by Hugging Face name) of a llama-architecture GGUF; with
    num_layers only the first that many layers are read (the config says so)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    config = gguf_config(reader, path)
    if num_layers is not None:
        if not 1 <= num_layers <= config.num_hidden_layers:
            raise ValueError(f"num_layers must be in [1, {config.num_hidden_layers}], got {num_layers}")
        config = config.replace(num_hidden_layers=num_layers)
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    fixed["output.weight"] = "lm_head.weight"
    state = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name in fixed:
            hf = fixed[name]
        elif name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if int(layer) >= config.num_hidden_layers:
                continue
            part, _, suffix = rest.rpartition(".")
            part = _HF_NAMES.get(rest) or _HF_NAMES.get(part)
            if part is None:
                raise CheckpointError(f"{path}: tensor {name!r} has no place in verispec's Llama")
            hf = f"model.layers.{layer}.{part}" + ("" if part.endswith(("weight", "bias")) else f".{suffix}")
        else:
            continue  # rope_freqs and the like: not weights of this model
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest dimension first
        array = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        if hf.endswith("q_proj.weight"):
            array = _unpermute(array, config.num_attention_heads)
        elif hf.endswith("k_proj.weight"):
            array = _unpermute(array, config.num_key_value_heads)
        state[hf] = torch.from_numpy(np.ascontiguousarray(array))
    return config, state


def load_gguf_torch(path: str | Path, num_layers: int | None = None) -> LlamaForCausalLM:
    """The file as verispec's float32 PyTorch Llama (its first num_layers layers, if given)."""
    config, state = read_gguf_weights(path, num_layers)
    model = LlamaForCausalLM(config)
    state = from_hf_state_dict(state, config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the config: {(missing or unexpected)[:3]}")
    return model.eval()
