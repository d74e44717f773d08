"""Hugging Face format I/O for the Llama-family model.

Owns: reading and writing a model directory (`config.json`, `model.safetensors` or
shards with `model.safetensors.index.json`, and `tokenizer.json` when present).
Parameter names are Hugging Face's Llama/Qwen2/Mistral names. Every failure to read
raises `CheckpointError` with one line that names the directory and what is wrong.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .llama import LlamaConfig, LlamaForCausalLM, from_hf_state_dict, to_hf_state_dict

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
QUANT_METHOD = "verispec"  # int8 / int4 weight-only, models/quantize.py
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A model directory that cannot be read as a Llama-family checkpoint."""


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def config_path(directory: str | Path) -> Path:
    """directory/config.json, or a CheckpointError saying what `directory` is instead."""
    directory = Path(directory)
    path = directory / "config.json"
    if not path.is_file():
        if not directory.exists():
            raise CheckpointError(f"{directory}: no such file or directory")
        if directory.is_file():
            raise CheckpointError(f"{directory}: a file, not a model directory (a GGUF file must end in .gguf)")
        raise CheckpointError(f"{directory}: no config.json (not a Hugging Face model directory)")
    return path


def read_config(directory: str | Path) -> LlamaConfig:
    return _read_configs(directory)[0]


def _read_configs(directory: str | Path) -> tuple[LlamaConfig, dict | None]:
    """The model config and verispec's quantization_config (None for a float model)."""
    path = config_path(directory)
    try:
        hf = json.loads(path.read_text())
        quantization = hf.get("quantization_config")
        if quantization is not None and quantization.get("quant_method") != QUANT_METHOD:
            raise ValueError(f"quantization_config {quantization!r} is not verispec's ({QUANT_METHOD})")
        return LlamaConfig.from_hf(hf), quantization
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: {type(error).__name__}: {error}") from None


def _read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    try:
        if single.is_file():
            return load_file(str(single))
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(load_file(str(directory / shard)))
            return state
    except (OSError, SafetensorError, json.JSONDecodeError, KeyError) as error:
        raise CheckpointError(f"{directory}: unreadable weights: {error}") from None
    raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")


def load_pretrained(
    directory: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LlamaForCausalLM:
    """Load a Hugging Face Llama/Qwen2/Mistral directory into verispec's model."""
    directory = Path(directory)
    config, quantization = _read_configs(directory)
    state = _read_state_dict(directory)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state and "lm_head.qweight" not in state and "model.embed_tokens.weight" in state:
        raise CheckpointError(f"{directory}: lm_head.weight missing while tie_word_embeddings is false")
    state = from_hf_state_dict(state, config)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        if quantization is not None:
            from .quantize import quantize_model

            quantize_model(
                model, quantization["bits"], quantization["group_size"], head_bits=quantization.get("head_bits")
            )
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = config.tie_word_embeddings and "lm_head.weight" in shapes  # a quantized head has codes of its own
    if tied:
        shapes.pop("lm_head.weight")
    expected = set(shapes)
    missing, unexpected = expected - set(state), set(state) - expected
    unexpected = {name for name in unexpected if not name.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        what = f"missing {sorted(missing)[:3]}" if missing else f"unexpected {sorted(unexpected)[:3]}"
        raise CheckpointError(f"{directory}: weights do not match the config: {what}")
    for name, tensor in state.items():
        if name in expected and tuple(tensor.shape) != shapes[name]:
            raise CheckpointError(f"{directory}: {name} has shape {tuple(tensor.shape)}, config implies {shapes[name]}")
    model.load_state_dict(
        {
            n: t if not t.is_floating_point() or n.endswith(".scale") else t.to(dtype)
            for n, t in state.items()
            if n in expected
        },
        assign=True,
        strict=False,
    )
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device).eval()


def save_pretrained(
    model: LlamaForCausalLM,
    directory: str | Path,
    max_shard_bytes: int | None = None,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write config.json and safetensors (sharded above max_shard_bytes); copy tokenizer files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = model.config
    hf = config.to_hf(model.dtype)
    if getattr(model, "quantization", None):
        hf["quantization_config"] = {**model.quantization, "quant_method": QUANT_METHOD}
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    state = {n: t.detach().contiguous().cpu() for n, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # absent when the head is quantized
    state = to_hf_state_dict(state, config)
    shards = _shard(state, max_shard_bytes)
    for stale in directory.glob("model*.safetensors*"):
        stale.unlink()
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / name), metadata={"format": "pt"})
            weight_map.update({tensor_name: name for tensor_name in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, directory)
    return directory


def _shard(state: dict[str, torch.Tensor], max_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def copy_tokenizer(source: str | Path, destination: str | Path) -> None:
    for name in TOKENIZER_FILES:
        path = Path(source) / name
        if path.is_file() and Path(source).resolve() != Path(destination).resolve():
            shutil.copy(path, Path(destination) / name)


def load_tokenizer(directory: str | Path):
    """The `tokenizers.Tokenizer` from directory/tokenizer.json, or None when there is none."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # the tokenizers library raises its own exception types
        raise CheckpointError(f"{path}: unreadable tokenizer: {error}") from None
