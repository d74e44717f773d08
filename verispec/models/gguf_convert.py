"""Hugging Face Llama-family directory -> GGUF file for llama.cpp.

Owns: `convert` (config, weights and tokenizer of a Llama/Mistral/Qwen2 directory into one GGUF
file of type f32, f16, bf16, q8_0 or q4_0), `cached_gguf` (convert once per weights and type into a
cache directory) and `gguf_vocab` (a GGUF's token -> id map and special tokens, to compare with
a `tokenizer.json`). Reads the directory with `checkpoint.py`'s loaders and writes with the
`gguf` package; llama.cpp's `convert_hf_to_gguf.py` is the reference for names and layout.

Two things must match llama.cpp exactly or its logits silently differ from verispec's:
- RoPE. Hugging Face rotates halves (x[:d/2], x[d/2:]); llama.cpp's "llama" architecture
  rotates adjacent pairs, so q_proj and k_proj rows are permuted per head (`_permute`). The
  "qwen2" architecture rotates halves (NEOX) like Hugging Face and is written unpermuted.
- Tokenization. Only tokenizers whose pre-tokenizer llama.cpp implements are written:
  byte-level BPE with GPT-2's regex ("gpt-2"), or with Llama 3's or Qwen2's split regex
  ("llama-bpe", "qwen2") and no normalizer. Anything else is refused with one line.
A directory without `tokenizer.json` gets a vocabulary of placeholders: a "gpt2" tokenizer whose
vocab_size tokens are all "[PAD{id}]" of type UNUSED. llama.cpp loads it, scores and samples ids,
and tokenizes any text to nothing; its "none" tokenizer model loads too, but there
`tokenize` aborts the whole process (GGML_ABORT), so it is not used.

Knows nothing of sampling, speculation or how llama.cpp is run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from pathlib import Path

import numpy as np
import torch

from ..paths import cache_home, notice
from .checkpoint import CheckpointError, _read_state_dict, load_tokenizer, read_config
from .llama import LlamaConfig

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")  # written here, with the gguf package
# every other type llama-quantize offers (lower case): written f32 here, then quantized by llama.cpp's own quantizer
QUANTIZED_TYPES = tuple(
    name.lower()
    for name in (
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q2_K",
        "Q3_K_S",
        "Q3_K_M",
        "Q3_K_L",
        "Q4_K_S",
        "Q4_K_M",
        "Q5_K_S",
        "Q5_K_M",
        "Q6_K",
        "IQ4_NL",
        "IQ4_XS",
    )
)
ALL_TYPES = TYPES + QUANTIZED_TYPES
_FILE_TYPES = {
    "f32": "ALL_F32",
    "f16": "MOSTLY_F16",
    "bf16": "MOSTLY_BF16",
    "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0",
}  # general.file_type
_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_FORMAT_VERSION = 1  # part of the cache key: bump when the written file changes
_BLOCK = 32  # the Q8_0 / Q4_0 block length; a row must be a whole number of blocks
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_INERT_MERGE = "<no-merge> <no-merge>"
_SPLIT_PRE = {  # (Split regex of tokenizer.json, BPE ignore_merges) -> llama.cpp's name for that pre-tokenizer
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| "
        r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        True,
    ): "llama-bpe",
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| "
        r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        False,
    ): "qwen2",
}


def convert(model_dir: str | Path, out_path: str | Path, type: str = "f32", *, _permute_qk: bool = True) -> Path:
    """Write model_dir (a Hugging Face Llama/Mistral/Qwen2 directory) as one GGUF file.

    type: f32, f16 or bf16 (every matrix in that format; bf16 keeps bfloat16 checkpoints exact), q8_0 or
    q4_0 (every matrix whose rows are a whole number of 32-value blocks; other matrices f16). With q4_0 the
    token embedding and the output head are q8_0 (llama.cpp's own q4_0 uses q6_K there, which `gguf` cannot write).
    Norms and biases stay f32. The file is written next to out_path and renamed into place, so
    a reader never sees half a file. `_permute_qk=False` is for tests (a wrong file on purpose).
    """
    from gguf import GGUFWriter, LlamaFileType

    type = type.lower()
    model_dir, out_path = Path(model_dir), Path(out_path)
    if type in QUANTIZED_TYPES:  # f32 first, then llama.cpp's quantizer (llamacpp/quantize.py)
        from ..llamacpp.quantize import quantize

        out_path.parent.mkdir(parents=True, exist_ok=True)
        plain = out_path.with_name(f".{out_path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.f32.tmp")
        try:
            convert(model_dir, plain, "f32", _permute_qk=_permute_qk)
            return quantize(plain, out_path, type)
        finally:
            plain.unlink(missing_ok=True)
    qtype = _check_type(type)
    config = _read_float_config(model_dir)
    arch = _ARCH[config.model_type]
    tokenizer = _tokenizer_fields(model_dir, config)
    state = _read_state_dict(model_dir)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    temp = out_path.with_name(f".{out_path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    writer = GGUFWriter(temp, arch)
    try:
        _write_metadata(writer, config, arch, model_dir.resolve().name)
        writer.add_file_type(getattr(LlamaFileType, _FILE_TYPES[type]))
        _write_tokenizer(writer, tokenizer, config)
        for name, array in _gguf_tensors(state, config, permute=_permute_qk and arch == "llama", directory=model_dir):
            data, raw_type = _encode(name, array, qtype)
            writer.add_tensor(name, data, raw_dtype=raw_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(temp, out_path)
    finally:
        writer.close()
        temp.unlink(missing_ok=True)
    return out_path


def cached_gguf(model_dir: str | Path, type: str = "f32", cache_dir: str | Path | None = None) -> Path:
    type = type.lower()
    if type in QUANTIZED_TYPES:  # llama.cpp's quantizer, from the cached f32 file
        from ..llamacpp.quantize import quantize

        source = cached_gguf(model_dir, "f32", cache_dir)
        path = source.with_name(source.name.replace("-f32.gguf", f"-{type}.gguf"))
        return path if path.is_file() else quantize(source, path, type)
    return _cached(model_dir, type, cache_dir)


def _cached(model_dir: str | Path, type: str, cache_dir: str | Path | None) -> Path:
    """The GGUF of model_dir in `type`, converted on the first call and reused after.

    The cache (`gguf` under verispec's cache, paths.py: `$VERISPEC_CACHE`, `$XDG_CACHE_HOME/verispec`, else
    `~/.cache/verispec`) is keyed
    by the sha256 of the contents of config.json, the tokenizer files and every safetensors
    file (and the index), plus the type and this converter's format version: hashing the
    built-in 113 MB target takes 0.1-0.2 s from the page cache, so contents, not (size,
    mtime), decide. `convert` renames a finished file into place, so concurrent callers
    never read a partial one (at worst both convert and the second rename wins).
    """
    _check_type(type)
    model_dir = Path(model_dir)
    _read_float_config(model_dir)
    if cache_dir is None:
        cache_dir = cache_home() / "gguf"
    path = Path(cache_dir) / f"{model_dir.resolve().name}-{_weights_digest(model_dir)[:20]}-{type}.gguf"
    if not path.is_file():
        notice(f"converting {model_dir} to GGUF ({type}) into {cache_dir} (once; cached)")
        convert(model_dir, path, type)
    return path


def gguf_vocab(path: str | Path) -> tuple[dict[str, int], set[str]]:
    """(token -> id, special tokens) of a GGUF file; special means CONTROL type.

    Placeholder tokens (UNUSED type: ids in the model's vocabulary beyond the tokenizer's) are
    left out, so the map equals `tokenizers.Tokenizer.get_vocab(with_added_tokens=True)` of
    the directory it was converted from. A file without a vocabulary gives ({}, set()).
    """
    from gguf import GGUFReader, TokenType

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable GGUF: {error}") from None
    tokens_field = reader.fields.get("tokenizer.ggml.tokens")
    if tokens_field is None:
        return {}, set()
    tokens = tokens_field.contents()
    types_field = reader.fields.get("tokenizer.ggml.token_type")
    types = types_field.contents() if types_field is not None else [TokenType.NORMAL] * len(tokens)
    vocab = {token: i for i, (token, kind) in enumerate(zip(tokens, types)) if kind != TokenType.UNUSED}
    return vocab, {token for token, kind in zip(tokens, types) if kind == TokenType.CONTROL}


def _check_type(type: str):
    from gguf import GGMLQuantizationType as Q

    qtypes = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
    if type not in qtypes:
        raise ValueError(f"type must be one of {list(TYPES)}, got {type!r}")
    return qtypes[type]


def _read_float_config(model_dir: Path) -> LlamaConfig:
    path = model_dir / "config.json"
    if path.is_file():
        try:
            quantized = "quantization_config" in json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{path}: {error}") from None
        if quantized:
            raise CheckpointError(
                f"{model_dir}: a quantized directory (quantization_config); convert the float model and choose --type "
                "instead"
            )
    return read_config(model_dir)


def _weights_digest(model_dir: Path) -> str:
    digest = hashlib.sha256(f"verispec-gguf-{_FORMAT_VERSION}".encode())
    names = ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"]
    files = [model_dir / name for name in names] + sorted(model_dir.glob("*.safetensors"))
    for path in files:
        if path.is_file():
            digest.update(path.name.encode() + b"\0")
            with open(path, "rb") as handle:
                while chunk := handle.read(1 << 24):
                    digest.update(chunk)
    return digest.hexdigest()


def _write_metadata(writer, config: LlamaConfig, arch: str, name: str) -> None:
    from gguf import GGML_QUANT_VERSION

    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_quantization_version(GGML_QUANT_VERSION)


def _gguf_tensors(state: dict[str, torch.Tensor], config: LlamaConfig, permute: bool, directory: Path):
    """(GGUF name, float32 array) for every weight; q/k rows permuted for the llama arch."""
    if config.tie_word_embeddings:
        state = {name: t for name, t in state.items() if name != "lm_head.weight"}
    elif "lm_head.weight" not in state:
        raise CheckpointError(f"{directory}: lm_head.weight missing while tie_word_embeddings is false")
    for hf_name, tensor in state.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        array = tensor.detach().to(torch.float32).numpy()
        if permute and re.search(r"self_attn\.q_proj\.(weight|bias)$", hf_name):
            array = _permute(array, config.num_attention_heads)
        elif permute and re.search(r"self_attn\.k_proj\.(weight|bias)$", hf_name):
            array = _permute(array, config.num_key_value_heads)
        yield _gguf_name(hf_name, directory), array


def _gguf_name(hf_name: str, directory: Path) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+?)(\.weight|\.bias)?", hf_name)
    if match:
        layer, part, suffix = match.group(1), match.group(2), match.group(3) or ""
        if part + suffix in _LAYER_NAMES:
            return f"blk.{layer}.{_LAYER_NAMES[part + suffix]}"
        if part in _LAYER_NAMES:
            return f"blk.{layer}.{_LAYER_NAMES[part]}{suffix}"
    raise CheckpointError(f"{directory}: weight {hf_name!r} has no place in a llama.cpp Llama-family file")


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Rotate-half RoPE rows -> llama.cpp's interleaved pairs, per head (convert_hf_to_gguf's
    `LlamaModel.permute`): within each head, rows [0..d/2) and [d/2..d) are interleaved."""
    shape = weights.shape
    return weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _encode(name: str, array: np.ndarray, qtype) -> tuple[np.ndarray, object]:
    """The array in the file's type: norms and biases f32; q4_0's embedding and head q8_0;
    a matrix whose rows are not whole 32-value blocks f16."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    if array.ndim < 2:
        qtype = Q.F32
    elif qtype == Q.Q4_0 and name in ("token_embd.weight", "output.weight"):
        qtype = Q.Q8_0
    if qtype in (Q.Q8_0, Q.Q4_0) and array.shape[-1] % _BLOCK:
        qtype = Q.F16
    return quants.quantize(np.ascontiguousarray(array), qtype), qtype


def _tokenizer_fields(model_dir: Path, config: LlamaConfig) -> dict:
    """tokens, types, merges, pre-tokenizer name and add_bos/add_eos of tokenizer.json (placeholders without one)."""
    from gguf import TokenType

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:  # placeholders only: no text maps to them, gguf_vocab gives ({}, set())
        tokens = [f"[PAD{i}]" for i in range(config.vocab_size)]
        return {
            "tokens": tokens,
            "types": [TokenType.UNUSED] * len(tokens),
            "merges": [],
            "pre": "gpt-2",
            "add_bos": None,
            "add_eos": None,
        }
    path = model_dir / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if (
        model.get("type") != "BPE"
        or model.get("byte_fallback")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
    ):
        raise CheckpointError(
            f"{path}: only byte-level BPE tokenizers can be written to GGUF (model {model.get('type')!r})"
        )
    if spec.get("normalizer") is not None:
        raise CheckpointError(
            f"{path}: normalizer {spec['normalizer'].get('type')!r} has no llama.cpp equivalent for this converter"
        )
    pre = _pre_tokenizer_name(spec.get("pre_tokenizer"), bool(model.get("ignore_merges")), path)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if max(vocab.values()) >= config.vocab_size:
        raise CheckpointError(
            f"{path}: token id {max(vocab.values())} does not fit the model's vocab_size {config.vocab_size}"
        )
    added = tokenizer.get_added_tokens_decoder()
    by_id = {i: token for token, i in vocab.items()}
    tokens, types = [], []
    for i in range(config.vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(
                TokenType.NORMAL
                if i not in added
                else TokenType.CONTROL
                if added[i].special
                else TokenType.USER_DEFINED
            )
    if len(set(tokens)) != len(tokens):  # llama.cpp asserts that every token text is unique
        raise CheckpointError(f"{path}: a token's text equals a placeholder [PAD<id>] of the model's unused ids")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if any(len(m.split(" ")) != 2 for m in merges):
        raise CheckpointError(f"{path}: a merge contains a space, which GGUF's 'a b' merge strings cannot hold")
    return {"tokens": tokens, "types": types, "merges": merges, "pre": pre, **_added_ids(tokenizer, path)}


def _pre_tokenizer_name(pre: dict | None, ignore_merges: bool, path: Path) -> str:
    """llama.cpp's name for the pre-tokenizer (and whether whole in-vocabulary words skip the
    merges, which llama.cpp ties to the name), or CheckpointError naming it."""
    kind = (pre or {}).get("type")
    if (
        kind == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
        and not ignore_merges
    ):
        return "gpt-2"  # the ByteLevel regex is GPT-2's; llama.cpp spells the name "gpt-2" ("gpt2" fails to load)
    if kind == "Sequence" and len(pre.get("pretokenizers", [])) == 2:
        split, byte_level = pre["pretokenizers"]
        key = ((split.get("pattern") or {}).get("Regex"), ignore_merges)
        if (
            split.get("type") == "Split"
            and key in _SPLIT_PRE
            and split.get("behavior") == "Isolated"
            and not split.get("invert")
            and byte_level.get("type") == "ByteLevel"
            and not byte_level.get("use_regex", True)
            and not byte_level.get("add_prefix_space", False)
        ):
            return _SPLIT_PRE[key]
    described = json.dumps(pre)[:160] if pre else "none"
    raise CheckpointError(
        f"{path}: pre-tokenizer {described} (ignore_merges {ignore_merges}) has no known llama.cpp equivalent"
    )


def _added_ids(tokenizer, path: Path) -> dict:
    """What the tokenizer's post-processor adds around a text: nothing, a leading id (bos), a trailing id (eos)."""
    plain, full = tokenizer.encode("a", add_special_tokens=False).ids, tokenizer.encode("a").ids
    start = full.index(plain[0]) if plain and plain[0] in full else -1
    if start < 0 or full[start : start + len(plain)] != plain or start > 1 or len(full) - start - len(plain) > 1:
        raise CheckpointError(f"{path}: post-processor adds {full} around {plain}, which llama.cpp cannot repeat")
    return {"add_bos": full[0] if start == 1 else None, "add_eos": full[-1] if len(full) > start + len(plain) else None}


def _write_tokenizer(writer, fields: dict, config: LlamaConfig) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["types"])
    # gguf's writer drops (and cannot write) an empty array, but llama.cpp refuses a BPE without
    # the merges key: a merge-less tokenizer (the toy's bytes) gets one merge of two symbols
    # that no text can produce (only merges build multi-character symbols), so it never applies.
    writer.add_token_merges(fields["merges"] or [_INERT_MERGE])
    eos = fields["add_eos"] if fields["add_eos"] is not None else config.eos_token_id
    bos = fields["add_bos"] if fields["add_bos"] is not None else config.bos_token_id
    if eos is not None:
        writer.add_eos_token_id(eos)
    # Without a bos token llama.cpp's gpt2 default (id 11, an ordinary token) would stand in; GPT-2's
    # own convention (bos = eos) is harmless since nothing adds it.
    if bos is not None or eos is not None:
        writer.add_bos_token_id(bos if bos is not None else eos)
    writer.add_add_bos_token(fields["add_bos"] is not None)
    writer.add_add_eos_token(fields["add_eos"] is not None)
