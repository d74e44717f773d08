"""Self-speculative drafting: the target's own first L layers, then its final norm and head.

Owns `early_exit_model` (a `LlamaForCausalLM` whose modules ARE the target's first L layers,
embeddings, final norm and output head: shared tensors, no copy, no second network to
load) and `EarlyExitDrafter`, a `ModelDrafter` over it. The draft keeps its own KV cache for
its L layers. Reusing the target's cache for the shared layers is not done yet: the target's
verification pass overwrites those positions with identical values anyway, so sharing would
save the draft's cache memory and its catch-up passes, not change any result.
Knows nothing of sampling beyond what ModelDrafter does.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.llama import LlamaForCausalLM
from .model import ModelDrafter


def early_exit_model(target: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """A model made of the target's first num_layers layers, its final norm and its head."""
    total = target.config.num_hidden_layers
    if not isinstance(num_layers, int) or not 1 <= num_layers < total:
        raise ValueError(f"num_layers must be an integer in [1, {total - 1}] for a {total}-layer target, got {num_layers!r}")
    with torch.device("meta"):
        draft = LlamaForCausalLM(target.config.replace(num_hidden_layers=num_layers))
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = nn.ModuleList(target.model.layers[:num_layers])
    draft.model.norm = target.model.norm
    draft.lm_head = target.lm_head
    return draft.eval()


class EarlyExitDrafter(ModelDrafter):
    """Drafts with the target's first `num_layers` layers (LayerSkip-style self-speculation)."""

    def __init__(self, target: LlamaForCausalLM, num_layers: int):
        super().__init__(early_exit_model(target, num_layers))
        self.num_layers = num_layers
