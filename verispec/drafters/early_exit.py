"""Self-speculative drafting: the target's own first L layers, then its final norm and head.

Owns `early_exit_model` (a `LlamaForCausalLM` whose modules ARE the target's first L layers,
embeddings, final norm and output head: shared tensors, no copy, no second network to
load) and `EarlyExitDrafter`.

The drafter reuses the target's KV cache for its L layers (`SharedLayersCache`: a view of
the target cache's first L layers with lengths of its own). Why that is exact and free:
- The target's verification pass feeds the pending token and the k proposals at positions
  n..n+k and writes ALL its layers there, the first L included. So after every pass the
  shared layers already hold the committed tokens: the draft never prefills and never
  catches up (ModelDrafter's two pending tokens after a full acceptance do not arise).
- The draft writes only at n..n+k-1 (the pending token and x_1..x_{k-1}), positions the
  target's next pass overwrites before anything reads them. It never writes a committed
  position, so the target's results do not depend on the draft, bit for bit.
- After a pass, the draft's lengths are set to the target's (which may be one more than
  the draft wrote: the target wrote x_k there).
When the engine does not offer its cache (another caller, or a target that is not a
verispec Llama), the drafter keeps a cache of its own, as ModelDrafter does.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..models.cache import CacheLengths
from ..models.llama import KVCache, LlamaForCausalLM
from .model import ModelDrafter


def early_exit_model(target: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """A model made of the target's first num_layers layers, its final norm and its head."""
    total = target.config.num_hidden_layers
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or not 1 <= num_layers < total:
        raise ValueError(f"early exit takes 1 to {total - 1} of the target's {total} layers, got {num_layers!r}")
    # Shallow copies that share every parameter (no allocation, no initialisation).
    draft = copy.copy(target)
    draft._modules = dict(target._modules)
    inner = copy.copy(target.model)
    inner._modules = dict(target.model._modules)
    inner.layers = nn.ModuleList(target.model.layers[:num_layers])
    draft.model = inner
    draft.config = target.config.replace(num_hidden_layers=num_layers)
    draft._rope = None
    return draft.eval()


class SharedLayersCache(CacheLengths):
    """The first L layers of a target's KVCache (views, no copy) with lengths of their own."""

    def __init__(self, target_cache: KVCache, num_layers: int):
        super().__init__(target_cache.batch_size, target_cache.max_length, target_cache.lengths.device)
        self.target_cache, self.num_layers = target_cache, num_layers
        self.follow(target_cache)

    @property
    def keys(self) -> torch.Tensor:  # [L, B, S_max, H_kv, D], the target's storage
        return self.target_cache.keys[: self.num_layers]

    @property
    def values(self) -> torch.Tensor:
        return self.target_cache.values[: self.num_layers]

    def follow(self, target_cache: CacheLengths) -> None:
        """Take the target's lengths (which may be longer than what the draft wrote)."""
        self.lengths = target_cache.lengths.clone()
        self._host_lengths = target_cache.host_lengths


class EarlyExitDrafter(ModelDrafter):
    """Drafts with the target's first `num_layers` layers (LayerSkip-style self-speculation)."""

    shares_target_cache = True  # the engine passes its cache to start(..., target_cache=)

    def __init__(self, target: LlamaForCausalLM, num_layers: int):
        super().__init__(early_exit_model(target, num_layers))
        self.num_layers = num_layers
        self.target_cache: KVCache | None = None

    def start(self, prompts: list[list[int]], max_length: int, target_cache: KVCache | None = None) -> None:
        if not isinstance(target_cache, KVCache):  # nothing to share: a cache of its own
            self.target_cache = None
            return super().start(prompts, max_length)
        # The engine has prefilled p[:-1] into the target cache; the last prompt token is pending.
        self.target_cache = target_cache
        self.cache = SharedLayersCache(target_cache, self.num_layers)
        self.pending = torch.tensor([[p[-1]] for p in prompts], dtype=torch.long, device=self.model.device)  # [B, 1]
        self.pending_count = [1] * len(prompts)
        self.proposal.start(len(prompts))

    @property
    def can_change_rows(self) -> bool:
        return self.target_cache is not None or super().can_change_rows

    def keep_rows(self, rows: list[int]) -> None:
        if self.target_cache is None:
            return super().keep_rows(rows)
        # The engine has kept the same rows of the target's cache: the layers moved with them.
        self.cache.follow(self.target_cache)
        self.pending = self.pending.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.pending.device))
        self.pending_count = [1] * len(rows)
        self.proposal.keep_rows(rows)

    def reserve_row(self):
        return (
            super().reserve_row() if self.target_cache is None else None
        )  # shared: the target's reserved row holds the layers

    def add_rows(self, prompts: list[list[int]], views: list | None = None) -> None:
        if self.target_cache is None:
            return super().add_rows(prompts, views)
        # The engine has prefilled these rows' p[:-1] into the target's cache: the layers are there.
        self.cache.follow(self.target_cache)
        last = torch.tensor([[p[-1]] for p in prompts], dtype=torch.long, device=self.pending.device)
        self.pending = torch.cat([self.pending, last])
        self.pending_count = [1] * self.pending.shape[0]
        self.proposal.add_rows(len(prompts))

    @property
    def joined_unread(self) -> int:
        return (
            super().joined_unread if self.target_cache is None else 0
        )  # shared: the target's prefill wrote the layers

    def read_joined(self) -> None:
        if self.target_cache is None:
            super().read_joined()

    def prefill(self) -> None:
        if self.target_cache is None:  # shared: the target's prefill already wrote these layers
            super().prefill()

    def commit(self, num_accepted: list[int], next_token_ids: torch.Tensor, active: list[bool]) -> None:
        if self.target_cache is None:
            return super().commit(num_accepted, next_token_ids, active)
        # The target (already rolled back) holds every committed token but the new pending one.
        self.cache.follow(self.target_cache)
        live = torch.tensor(active, device=self.pending.device)
        self.pending = torch.where(live, next_token_ids, self.pending[:, 0])[:, None]
