"""A tiny, randomly initialised target/draft pair with a byte-level tokenizer.

For smoke tests, examples and the command line before any trained weights are at hand:
both directories are ordinary Hugging Face model directories (config.json,
model.safetensors, tokenizer.json). The weights are random, so the text is noise; the
draft is the target's first layer (same embeddings and head), so acceptance is moderate.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import save_pretrained
from .llama import LlamaConfig, LlamaForCausalLM, init_weights

EOS = "<|endoftext|>"


def byte_level_tokenizer():
    """A byte-level BPE with no merges: 256 byte tokens, then <|endoftext|> (id 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])
    return tokenizer


def make_toy_pair(
    directory: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32, sizes: str = "tiny"
) -> tuple[Path, Path]:
    """Write directory/target and directory/draft; return their paths.

    sizes="tiny": a 4-layer target and its first layer as the draft. sizes="kquant": the same
    with rows of 256 values (2 layers), so that llama.cpp's K-quants and IQ4 types apply to every
    matrix rather than falling back to other types. sizes="presets": the
    architectures of the built-in pair (models.presets.PRESETS), random weights, for measuring
    speed before trained weights exist (the byte tokenizer uses only the first 257 ids).
    """
    directory = Path(directory)
    tokenizer = byte_level_tokenizer()
    eos = tokenizer.token_to_id(EOS)
    if sizes == "presets":
        from .presets import PRESETS

        target = init_weights(LlamaForCausalLM(PRESETS["target"].replace(eos_token_id=eos)), seed=seed).to(dtype)
        draft = init_weights(LlamaForCausalLM(PRESETS["draft"].replace(eos_token_id=eos)), seed=seed + 1).to(dtype)
    elif sizes in ("tiny", "kquant"):
        wide = sizes == "kquant"
        config = LlamaConfig(
            vocab_size=tokenizer.get_vocab_size(),
            hidden_size=256 if wide else 128,
            intermediate_size=512 if wide else 384,
            num_hidden_layers=2 if wide else 4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64 if wide else 32,
            tie_word_embeddings=True,
            eos_token_id=eos,
        )
        target = init_weights(LlamaForCausalLM(config), std=0.1, seed=seed).to(dtype)
        draft = LlamaForCausalLM(config.replace(num_hidden_layers=1)).to(dtype)
        draft.load_state_dict(target.state_dict(), strict=False)
    else:
        raise ValueError(f"sizes must be 'tiny', 'kquant' or 'presets', got {sizes!r}")
    paths = directory / "target", directory / "draft"
    for model, path in zip((target, draft), paths):
        save_pretrained(model, path)
        tokenizer.save(str(path / "tokenizer.json"))
    return paths
