"""The built-in pair's architectures, as `LlamaConfig`s (sizes chosen in MODEL_CARD.md).

Owns `PRESETS`: "target" and "draft" (the built-in pair), "tiny" (tests). Training
(`verispec.train`), the toy pair and the CLI's cost-only presets read them from here.
"""

from __future__ import annotations

from .llama import LlamaConfig


def _preset(d: int, layers: int, ff: int, heads: int, kv_heads: int, vocab: int = 8192) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=d // heads,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        eos_token_id=0,
    )


PRESETS: dict[str, LlamaConfig] = {
    "target": _preset(768, 8, 2048, 12, 4),
    "draft": _preset(256, 2, 768, 4, 2),
    "tiny": _preset(32, 1, 64, 2, 1),
}
