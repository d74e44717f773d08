"""A Llama-family causal LM (Llama, Qwen2, Mistral) with a preallocated, roll-back-able KV cache.

Owns: `LlamaConfig` (read from a Hugging Face `config.json`), `KVCache` and
`LlamaForCausalLM`. Parameter names are Hugging Face's, so a `model.safetensors` loads
as a plain state dict. RMSNorm, RoPE (rope_theta), SwiGLU MLP, grouped-query attention,
optional q/k/v biases (Qwen2), tied or untied embeddings, float32 or bfloat16.

Cache contract: row b holds `lengths[b]` valid positions. A forward of T tokens writes
positions lengths[b] .. lengths[b]+T-1 of every row, attends causally in absolute
positions, and advances every length by T. Rolling back is `cache.rollback(new_lengths)`:
stale entries beyond a row's length are masked, then overwritten by the next forward,
never copied. Rows may hold different lengths (ragged prompts, different acceptance).
Knows nothing of sampling or speculation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .cache import CacheLengths
from .kernels import Linear

PREFILL_CHUNK = 512  # positions per prefill pass at most (fewer for long contexts: see prefill)
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.model_type not in _ARCHITECTURES:
            raise ValueError(f"model_type must be one of {sorted(_ARCHITECTURES)}, got {self.model_type!r}")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """Build from a Hugging Face config.json dict; refuse what this model cannot run exactly."""
        model_type = hf.get("model_type", "llama")
        if model_type not in _ARCHITECTURES:
            raise ValueError(
                f"model_type {model_type!r} is not a Llama-family model (supported: {sorted(_ARCHITECTURES)})"
            )
        rope_scaling = hf.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
            raise ValueError(f"rope_scaling {rope_scaling!r} is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        heads = hf["num_attention_heads"]
        window = hf.get("sliding_window") if hf.get("use_sliding_window", model_type == "mistral") else None
        if window is not None and window < hf.get("max_position_embeddings", 2048):
            raise ValueError(f"sliding_window {window} is not supported")
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            model_type=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) and eos else eos,
        )

    def to_hf(self, dtype: torch.dtype) -> dict[str, Any]:
        hf = {f.name: getattr(self, f.name) for f in fields(self)}
        hf.update(
            architectures=[_ARCHITECTURES[self.model_type]],
            hidden_act="silu",
            torch_dtype=str(dtype).removeprefix("torch."),
        )
        if self.model_type != "llama":
            hf.pop("attention_bias")  # implied by the architecture in transformers
        return hf

    def replace(self, **changes: Any) -> LlamaConfig:
        return LlamaConfig(**{**asdict(self), **changes})

    @property
    def num_parameters(self) -> int:
        d, f, L, v = self.hidden_size, self.intermediate_size, self.num_hidden_layers, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.attention_bias else 0)
        per_layer = attn + 3 * d * f + 2 * d
        return L * per_layer + d + v * d * (1 if self.tie_word_embeddings else 2)


class KVCache(CacheLengths):
    """Preallocated keys and values [layers, B, S_max, H_kv, D] with a valid length per row.

    Storage for `batch_size` rows; the batch is its first B rows (`keys`, `values` are views),
    so rows leave (`keep_rows`: the kept rows' valid positions move down, once) and join
    (`add_rows`, up to the storage's rows) without a copy per pass."""

    def __init__(
        self, config: LlamaConfig, batch_size: int, max_length: int, dtype: torch.dtype, device: torch.device | str
    ):
        super().__init__(batch_size, max_length, device)
        shape = (config.num_hidden_layers, batch_size, max_length, config.num_key_value_heads, config.head_dim)
        self._keys = torch.zeros(shape, dtype=dtype, device=device)
        self._values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def keys(self) -> torch.Tensor:  # [L, B, S_max, H_kv, D], a view
        return self._keys[:, : self.batch_size]

    @property
    def values(self) -> torch.Tensor:
        return self._values[:, : self.batch_size]

    def keep_rows(self, rows: list[int]) -> None:
        lengths = self.host_lengths
        self._keep_lengths(rows)
        for new, old in enumerate(rows):
            if new != old:  # ascending rows: new < old, so nothing kept is overwritten
                self._keys[:, new, : lengths[old]] = self._keys[:, old, : lengths[old]]
                self._values[:, new, : lengths[old]] = self._values[:, old, : lengths[old]]

    def add_rows(self, count: int) -> None:
        reserved = len(getattr(self, "_reserved", ()))
        if self.batch_size + count + reserved > self._keys.shape[1]:
            raise ValueError(
                f"the cache holds {self._keys.shape[1]} rows; {self.batch_size} + {count} asked for ({reserved} "
                "reserved)"
            )
        self._add_lengths(count)

    # A prompt can be prefilled piece by piece before its request joins (the server's chunked
    # prefill): `reserve_row` gives a one-row cache over free storage (the highest free row, so
    # that rows added meanwhile do not meet it), the model writes the prompt into it, and
    # `adopt_row` makes it the batch's last row (one copy of its valid positions), or
    # `release_row` gives it up.
    def reserve_row(self) -> KVCache:
        self._reserved = getattr(self, "_reserved", set())
        top = self._keys.shape[1] - 1 - len(self._reserved)
        if top < self.batch_size:
            raise ValueError(f"the cache holds {self._keys.shape[1]} rows; none is free to reserve")
        view = KVCache.__new__(KVCache)
        CacheLengths.__init__(view, 1, self.max_length, self.lengths.device)
        view._keys, view._values, view._storage_row = self._keys[:, top : top + 1], self._values[:, top : top + 1], top
        self._reserved.add(top)
        return view

    def adopt_row(self, view: KVCache) -> None:
        row, length = self.batch_size, view.host_lengths[0]
        self._reserved.discard(view._storage_row)
        if view._storage_row != row:
            self._keys[:, row, :length] = self._keys[:, view._storage_row, :length]
            self._values[:, row, :length] = self._values[:, view._storage_row, :length]
        self.set_lengths(self._host_lengths + [length])

    def release_row(self, view: KVCache) -> None:
        self._reserved.discard(view._storage_row)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(config: LlamaConfig, max_length: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_length, head_dim] in float32, laid out as in transformers (halves repeated)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    freqs = torch.outer(torch.arange(max_length, device=device).float(), inv_freq)  # [S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, D]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos, sin [B, T, 1, D] float32. Computed in float32."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    if x.dtype == torch.float32:
        return x * cos + rotated * sin
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def grouped_attention(
    q: torch.Tensor,  # [B, T, H, D]
    keys: torch.Tensor,  # [B, S, H_kv, D]
    values: torch.Tensor,  # [B, S, H_kv, D]
    mask: torch.Tensor,  # [B, 1, T, S] float: 0 = attend, -inf = masked
) -> torch.Tensor:
    """Masked attention with grouped query heads, for few query rows -> [B, T, H, D].

    Query head h reads key/value head h // (H / H_kv), as in transformers; the G query heads
    of a group are stacked into one matrix product per key/value head, without copying keys.
    """
    batch, length, heads, dim = q.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    q = q.view(batch, length, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, group * length, dim)
    scores = torch.matmul(q.float(), keys.permute(0, 2, 3, 1).float()) / math.sqrt(dim)  # [B, H_kv, G*T, S]
    scores = scores.view(batch, kv_heads, group, length, -1) + mask[:, :, None]  # [B, H_kv, G, T, S]
    out = torch.matmul(scores.view(batch, kv_heads, group * length, -1).softmax(dim=-1), values.transpose(1, 2).float())
    return (
        out.to(q.dtype)
        .view(batch, kv_heads, group, length, dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(batch, length, heads, dim)
    )


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, d]
        cos: torch.Tensor,  # [B, T, 1, D]
        sin: torch.Tensor,  # [B, T, 1, D]
        keys: torch.Tensor | None,  # [B, S_max, H_kv, D] this layer's cache, or None
        values: torch.Tensor | None,  # [B, S_max, H_kv, D]
        write_at: tuple[torch.Tensor, torch.Tensor] | None,  # (rows [B, T], positions [B, T])
        mask: torch.Tensor | None,  # [B, 1, T, S] float: 0 = attend, -inf = masked
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(batch, length, heads + 2 * kv_heads, self.head_dim)  # q, k, v in one product
        qk = apply_rope(qkv[:, :, : heads + kv_heads], cos, sin)  # q and k rotated together
        q, k, v = qk[:, :, :heads], qk[:, :, heads:], qkv[:, :, heads + kv_heads :]
        if keys is None:  # no cache (training, scoring): plain causal attention over the input
            keys_all, values_all = k, v
        else:
            keys[write_at] = k
            values[write_at] = v
            keys_all, values_all = keys[:, : mask.shape[-1]], values[:, : mask.shape[-1]]
            if length <= 16:  # decoding and verification: a few rows, cheaper than SDPA's kernel
                return self.o_proj(grouped_attention(q, keys_all, values_all, mask).reshape(batch, length, -1))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys_all.transpose(1, 2),
            values_all.transpose(1, 2),
            attn_mask=mask,
            is_causal=keys is None,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, *attn_args: Any) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The model. `forward(input_ids [B, T], cache=None)` -> float32 logits [B, T, V]."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype  # (the head may be quantized)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        return KVCache(self.config, batch_size, max_length, self.dtype, self.device)

    def _rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].shape[0] < length or self._rope[0].device != self.device:
            self._rope = rope_tables(self.config, max(length, self.config.max_position_embeddings), self.device)
        return self._rope

    def hidden_states(
        self, input_ids: torch.Tensor, cache: KVCache | None, num_layers: int | None = None
    ) -> torch.Tensor:
        """Run the first num_layers layers (all by default) on input_ids [B, T] -> [B, T, d], not normed.

        With a cache: write and attend as the cache contract says, then advance it by T.
        Without one: the input is a whole sequence from position 0 (training, scoring).
        """
        batch, length = input_ids.shape
        device = input_ids.device
        if cache is None:
            positions = torch.arange(length, device=device).expand(batch, length)  # [B, T]
            span, write_at, mask = length, None, None
        else:
            span = max(cache.host_lengths) + length
            if span > cache.max_length:
                raise ValueError(f"KV cache overflow: {span} positions needed, cache holds {cache.max_length}")
            positions = cache.lengths[:, None] + torch.arange(length, device=device)  # [B, T]
            write_at = (torch.arange(batch, device=device)[:, None].expand(batch, length), positions)
            visible = torch.arange(span, device=device) <= positions[:, :, None]  # [B, T, S]
            mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))[
                :, None
            ]  # [B, 1, T, S]
        cos, sin = self._rope_tables(span)
        cos, sin = cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)  # [B, T, 1, D]
        x = self.model.embed_tokens(input_ids)
        layers = self.model.layers if num_layers is None else self.model.layers[:num_layers]
        for i, layer in enumerate(layers):
            keys, values = (None, None) if cache is None else (cache.keys[i], cache.values[i])
            x = layer(x, cos, sin, keys, values, write_at, mask)
        if cache is not None:
            cache.advance(length)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and output head: hidden [B, T, d] -> float32 logits [B, T, V]."""
        return self.lm_head(self.model.norm(hidden)).float()

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids, cache))

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], cache: KVCache) -> None:
        """Write ragged prompts [B][len_b] into an empty cache; lengths become len_b.

        In chunks of positions, so that the attention scores and the mask ([B, H, chunk, S])
        stay near 2**26 values: memory linear in the prompt's length, never quadratic."""
        longest = max(len(p) for p in prompts)
        if longest == 0:
            return
        ids = torch.zeros(len(prompts), longest, dtype=torch.long, device=self.device)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        chunk = max(16, min(PREFILL_CHUNK, 2**26 // (len(prompts) * self.config.num_attention_heads * longest)))
        for start in range(0, longest, chunk):
            self.hidden_states(ids[:, start : start + chunk], cache)
        cache.rollback([len(p) for p in prompts])

    @torch.no_grad()
    def prefill_rows(self, prompts: list[list[int]], cache: KVCache, rows: list[int]) -> None:
        """Rows rows[i] hold prompts[i] afterwards; the other rows are untouched (models/rows.py).
        Prefilled in a scratch cache of len(rows) rows, then copied into those rows."""
        longest = max((len(p) for p in prompts), default=0)
        if longest > cache.max_length:
            raise ValueError(f"KV cache overflow: {longest} positions needed, cache holds {cache.max_length}")
        if longest:
            scratch = self.new_cache(len(prompts), longest)
            self.prefill(prompts, scratch)
            index = torch.tensor(rows, device=cache.keys.device)
            cache.keys[:, index, :longest] = scratch.keys
            cache.values[:, index, :longest] = scratch.values
        lengths = cache.host_lengths
        for row, prompt in zip(rows, prompts):
            lengths[row] = len(prompt)
        cache.set_lengths(lengths)


# Hugging Face keeps q, k, v (and gate, up) as separate matrices; this model stacks them so that
# one product replaces several. These two functions are the only place that knows the mapping.
_PACKED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def from_hf_state_dict(state: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Hugging Face parameter names and matrices -> this model's (q/k/v and gate/up stacked)."""
    state = dict(state)
    for layer in range(config.num_hidden_layers):
        for packed, parts in _PACKED.items():
            for kind in ("weight", "bias", "qweight", "scale"):  # the last two: quantize.QuantLinear
                names = [f"model.layers.{layer}.{part}.{kind}" for part in parts]
                if all(name in state for name in names):
                    state[f"model.layers.{layer}.{packed}.{kind}"] = torch.cat([state.pop(name) for name in names])
    return state


def to_hf_state_dict(state: dict[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """This model's parameters -> Hugging Face names, q/k/v and gate/up split again."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    sizes = {
        "self_attn.qkv_proj": (q, kv, kv),
        "mlp.gate_up_proj": (config.intermediate_size, config.intermediate_size),
    }
    out = {}
    for name, tensor in state.items():
        packed = next((p for p in _PACKED if f".{p}." in name), None)
        if packed is None:
            out[name] = tensor
            continue
        prefix, kind = name.split(f".{packed}.")
        for part, piece in zip(_PACKED[packed], tensor.split(sizes[packed])):
            out[f"{prefix}.{part}.{kind}"] = piece.contiguous()
    return out


def init_weights(model: LlamaForCausalLM, std: float = 0.02, seed: int = 0) -> LlamaForCausalLM:
    """Normal(0, std) linear and embedding weights, unit norms, zero biases; scaled residual outputs."""
    generator = torch.Generator().manual_seed(seed)
    depth_scale = 1.0 / math.sqrt(2 * model.config.num_hidden_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                scale = depth_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                param.copy_(torch.randn(param.shape, generator=generator) * std * scale)
    return model
