"""Any `transformers` causal LM behind verispec's model interface; `load_model` picks the model.

Owns: `HFCausalLM`, an adapter that gives an `AutoModelForCausalLM` the interface the engine
and `ModelDrafter` use (`vocab_size`, `device`, `new_cache`, `prefill`, and
`forward(input_ids [B, T], cache) -> float32 logits [B, T, V]`); its cache `HFCache`; and
`load_model` (Llama-family directories go to verispec's own fast model, anything else to the
adapter). Knows nothing of sampling or speculation.

Rollback by masking. The transformers cache (a `DynamicCache`) has P "columns" that grow by T
per forward, for all rows alike. `HFCache.positions [B, P]` records the logical position each
column holds in each row, or HOLE. A forward of T tokens appends T columns at positions
lengths[b] .. lengths[b]+T-1, passed as `position_ids` (so RoPE or learned position
embeddings see the row's own positions), with a 2-D attention mask that hides the holes.
`rollback` lowers the lengths and turns every column at or beyond a row's new length into a
hole; then it crops (`DynamicCache.crop`) the trailing columns that are holes in every row.
A hidden column gets exactly zero attention weight, so each row computes what a fresh pass over
its committed tokens computes (up to float rounding of sums over a different key count).

Cost. Batch 1 (and any batch whose rows stay equally long): a rollback is a crop, the cache
holds exactly the committed tokens, no mask is built, and a forward feeds only its T new
tokens. Batch > 1 with rows that accept different counts: a forward still feeds only T tokens
per row, but rejected columns of the longer-lived rows stay as holes, so attention reads
P >= max(lengths) columns and the cache holds them; when P exceeds 2 * max(lengths) + 32 the
cache is compacted (each row's valid columns gathered to the right: one copy of the keys and
values), so P stays within about twice the longest row. transformers' `DynamicCache` already
copies the whole cache on every forward (it grows by concatenation), which is why verispec's
own Llama model, with a preallocated cache, is the fast path for Llama-family checkpoints.

Needs full-attention `DynamicLayer`s: sliding-window, static and recurrent (state-space) caches
cannot be rolled back this way, and `HFCausalLM` refuses them when it is built.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .cache import CacheLengths
from .checkpoint import QUANT_METHOD, CheckpointError, config_path, load_pretrained
from .llama import LlamaConfig

HOLE = torch.iinfo(torch.long).max  # the position of a column that holds nothing for a row
_COMPACT_SLACK = 32


class HFCache(CacheLengths):
    """A transformers `DynamicCache` with verispec's per-row lengths; rollback hides, then crops."""

    def __init__(self, hf_cache, batch_size: int, max_length: int, device: torch.device | str):
        super().__init__(batch_size, max_length, device)
        self.hf = hf_cache  # the transformers DynamicCache: [B, H, P, D] keys and values per layer
        self.positions = torch.empty(batch_size, 0, dtype=torch.long, device=device)  # [B, P], HOLE = hidden
        self._columns = np.zeros((batch_size, max_length), dtype=np.int64)  # host: column of (row, position)

    @property
    def num_columns(self) -> int:
        """P: the columns the transformers cache holds (committed positions plus holes)."""
        return self.positions.shape[1]

    def attention_mask(self, num_new: int) -> torch.Tensor | None:
        """[B, P + num_new] (1 = attend) for the next forward, or None when no row has a hole."""
        if min(self._host_lengths) == self.num_columns:  # row b holds exactly lengths[b] valid columns
            return None
        new = torch.ones(self.batch_size, num_new, dtype=torch.long, device=self.positions.device)
        return torch.cat([(self.positions != HOLE).long(), new], dim=1)

    def append(self, num_new: int) -> None:
        """Record a forward of num_new tokens per row: new columns at positions lengths[b]..; advance."""
        first_column = self.num_columns
        new_positions = self.lengths[:, None] + torch.arange(num_new, device=self.lengths.device)  # [B, T]
        self.positions = torch.cat([self.positions, new_positions], dim=1)
        starts = np.asarray(self._host_lengths)[:, None] + np.arange(num_new)  # [B, T]
        self._columns[np.arange(self.batch_size)[:, None], starts] = first_column + np.arange(num_new)
        self.advance(num_new)

    def rollback(self, lengths: list[int]) -> None:
        """Keep the first lengths[b] positions of row b: later columns become holes; trailing holes are cropped."""
        super().rollback(lengths)
        self.positions = self.positions.masked_fill(self.positions >= self.lengths[:, None], HOLE)
        new_lengths = np.asarray(lengths)
        rows = np.nonzero(new_lengths)[0]
        keep = int(self._columns[rows, new_lengths[rows] - 1].max()) + 1 if rows.size else 0
        if keep < self.num_columns:
            self.hf.crop(keep - self.num_columns)  # a negative count: remove that many trailing columns
            self.positions = self.positions[:, :keep]
        if self.num_columns > 2 * max(lengths) + _COMPACT_SLACK:
            self._compact()

    def keep_rows(self, rows: list[int]) -> None:
        self._keep_lengths(rows)
        index = torch.tensor(rows, dtype=torch.long, device=self.positions.device)
        for layer in self.hf.layers:
            if layer.is_initialized:
                layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self._columns = self._columns[rows]

    def add_rows(self, count: int) -> None:
        """New rows with every column a hole (length 0)."""
        self._add_lengths(count)
        for layer in self.hf.layers:
            if layer.is_initialized:
                pad = lambda states: torch.cat([states, states.new_zeros((count, *states.shape[1:]))])  # noqa: E731
                layer.keys, layer.values = pad(layer.keys), pad(layer.values)
        self.positions = torch.cat([self.positions, self.positions.new_full((count, self.num_columns), HOLE)])
        self._columns = np.concatenate([self._columns, np.zeros((count, self.max_length), dtype=np.int64)])

    def _compact(self) -> None:
        """Gather each row's valid columns to the right (holes, if any, on the left): P = max(lengths)."""
        width, columns = max(self._host_lengths), self.num_columns
        index = torch.arange(columns, device=self.positions.device).expand_as(self.positions)
        order = torch.where(self.positions != HOLE, index + columns, index).argsort(dim=1, stable=True)[
            :, columns - width :
        ]  # [B, width]
        for layer in self.hf.layers:
            if not layer.is_initialized:  # a layer that shares another's keys and values holds none
                continue
            for name in ("keys", "values"):
                states = getattr(layer, name)  # [B, H, P, D]
                gather_index = order[:, None, :, None].expand(states.shape[0], states.shape[1], width, states.shape[3])
                setattr(layer, name, states.gather(2, gather_index))
        self.positions = self.positions.gather(1, order)
        host = np.asarray(self._host_lengths)[:, None]
        self._columns[:] = width - host + np.arange(self.max_length)  # valid where position < length


class HFCausalLM(nn.Module):
    """A transformers causal LM with verispec's model interface (a target, or inside ModelDrafter).

    `forward(input_ids [B, T], cache)` writes positions cache.lengths .. +T-1 of every row and
    advances the lengths by T; without a cache it scores whole sequences from position 0.
    The wrapped model is put in eval mode (no dropout).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        from transformers.cache_utils import DynamicCache, DynamicLayer

        self.model = model.eval()
        self._dynamic_cache = DynamicCache
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"  # transformers >= 5.x / 4.x
        layers = DynamicCache(config=model.config).layers
        odd = [type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer]
        if odd:
            raise ValueError(
                f"{type(model).__name__}: cache layers of type {odd[0]} cannot be rolled back; the adapter needs "
                "full-attention layers"
            )

    @property
    def config(self):
        """The transformers config (eos_token_id and the like)."""
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        """The number of logits per position (the output embedding's rows, padding included)."""
        head = self.model.get_output_embeddings()
        if head is not None and getattr(head, "weight", None) is not None:
            return head.weight.shape[0]
        return self.model.config.get_text_config().vocab_size

    def new_cache(self, batch_size: int, max_length: int) -> HFCache:
        return HFCache(self._dynamic_cache(config=self.model.config), batch_size, max_length, self.device)

    def forward(self, input_ids: torch.Tensor, cache: HFCache | None = None) -> torch.Tensor:
        """input_ids [B, T] -> float32 logits [B, T, V]."""
        if cache is None:
            return self.model(input_ids=input_ids, use_cache=False).logits.float()
        batch, length = input_ids.shape
        span = max(cache.host_lengths) + length
        if span > cache.max_length:
            raise ValueError(f"KV cache overflow: {span} positions needed, cache holds {cache.max_length}")
        position_ids = cache.lengths[:, None] + torch.arange(length, device=input_ids.device)  # [B, T]
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=cache.attention_mask(length),  # [B, P + T] or None
            position_ids=position_ids,
            use_cache=True,
            **{self._cache_argument: cache.hf},
        )
        cache.append(length)
        return outputs.logits.float()

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], cache: HFCache) -> None:
        """Write ragged prompts [B][len_b] into an empty cache (padded on the right, then rolled back)."""
        longest = max(len(p) for p in prompts)
        if longest == 0:
            return
        padded = [list(prompt) + [0] * (longest - len(prompt)) for prompt in prompts]
        self(torch.tensor(padded, dtype=torch.long, device=self.device), cache)
        cache.rollback([len(p) for p in prompts])


def load_model(
    directory: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> nn.Module:
    """Load a Hugging Face model directory as a verispec model.

    Llama, Qwen2 and Mistral checkpoints that verispec's own model runs exactly load into
    `LlamaForCausalLM` (the fast path, verispec's own int8/int4 files included); anything else
    (other architectures; Llama-family configs it refuses, such as rope scaling or a sliding
    window; other libraries' quantization formats) is loaded with
    `transformers.AutoModelForCausalLM` and wrapped in `HFCausalLM`. Every failure to read
    raises `CheckpointError` with one line.
    """
    directory = Path(directory)
    path = config_path(directory)
    try:
        hf_config = json.loads(path.read_text())
        LlamaConfig.from_hf(hf_config)
        quantization = hf_config.get("quantization_config")
        native = quantization is None or quantization.get("quant_method") == QUANT_METHOD  # not GPTQ/AWQ/... files
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: {type(error).__name__}: {error}") from None
    except (KeyError, TypeError, ValueError, AttributeError):
        native = False  # not Llama-family, or a variant verispec's model does not run
    if native:
        return load_pretrained(directory, dtype, device)
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise CheckpointError(
            f"{directory}: a {hf_config.get('model_type')!r} model needs transformers (pip install 'verispec[hf]')"
        ) from None
    try:
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
    except Exception as error:  # transformers raises OSError, ValueError, KeyError, RuntimeError...
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise CheckpointError(f"{directory}: transformers cannot load it: {first_line}") from None
    try:
        return HFCausalLM(model.to(device))
    except ValueError as error:
        raise CheckpointError(f"{directory}: {error}") from None
