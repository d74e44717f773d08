"""A separate small draft model with its own KV cache.

Owns the draft model's cache and its "pending" tokens: committed tokens the draft model
has not consumed yet. After a step with a rejection only the recovered token is pending;
after a step where all k proposals were accepted, the last proposal x_k was never fed to
the draft model, so x_k and the bonus token are both pending and go in together at the
next propose (forgetting x_k is the bug that lowered acceptance in vLLM PR #9730).
"""

from __future__ import annotations

import torch

from ..config import SamplingParams
from ..models.llama import KVCache
from ..sampling import process_logits, sample


class ModelDrafter:
    """Drafts k tokens autoregressively with a causal LM (`forward(input_ids, cache)` -> logits)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cache: KVCache | None = None

    def start(self, prompts: list[list[int]], max_length: int) -> None:
        device = self.model.device
        self.cache = self.model.new_cache(len(prompts), max_length)
        self.model.prefill([p[:-1] for p in prompts], self.cache)
        self.pending = torch.zeros(len(prompts), 2, dtype=torch.long, device=device)  # [B, 2]
        self.pending[:, 0] = torch.tensor([p[-1] for p in prompts], device=device)
        self.pending_count = [1] * len(prompts)

    @torch.no_grad()
    def propose(self, k: int, params: SamplingParams, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.cache is not None, "start() first"
        batch = self.cache.batch_size
        self._start_lengths = self.cache.host_lengths
        self._k = k
        width = max(self.pending_count)
        logits = self.model(self.pending[:, :width], self.cache)  # [B, width, V]
        if width > 1:  # rows with one pending token fed a pad; keep only the real positions
            counts = torch.tensor(self.pending_count, device=logits.device)
            logits = logits[torch.arange(batch, device=logits.device), counts - 1][:, None]
            self.cache.rollback([n + c for n, c in zip(self._start_lengths, self.pending_count)])
        if k == 0:  # nothing to propose, but the pending tokens are consumed all the same
            self._last_proposal = self.pending[:, 0]
            return self.pending.new_zeros(batch, 0), logits.new_zeros(batch, 0, logits.shape[-1])
        token_ids, probs = [], []
        for i in range(k):
            if i > 0:
                logits = self.model(token_ids[-1][:, None], self.cache)
            q = process_logits(logits[:, -1], params)  # [B, V], the distribution drawn from
            token_ids.append(sample(q, generator))
            probs.append(q)
        draft_token_ids = torch.stack(token_ids, dim=1)  # [B, k]
        self._last_proposal = draft_token_ids[:, -1]
        return draft_token_ids, torch.stack(probs, dim=1)  # [B, k, V]

    def commit(self, num_accepted: list[int], next_token_ids: torch.Tensor, active: list[bool]) -> None:
        assert self.cache is not None
        k = self._k
        lengths, counts = [], []
        for start, count, n, live in zip(self._start_lengths, self.pending_count, num_accepted, active):
            if not live:
                lengths.append(start)
                counts.append(count)
            elif n < k or k == 0:  # fed: pending + x_1..x_{k-1}; valid: pending + x_1..x_n
                lengths.append(start + count + n)
                counts.append(1)
            else:  # all k accepted: x_k was never fed
                lengths.append(start + count + k - 1)
                counts.append(2)
        self.cache.rollback(lengths)
        live = torch.tensor(active, device=self.pending.device)
        two = torch.tensor([c == 2 for c in counts], device=self.pending.device)
        first = torch.where(two, self._last_proposal, next_token_ids)
        new_pending = torch.stack([first, next_token_ids], dim=1)  # [B, 2]
        self.pending = torch.where(live[:, None], new_pending, self.pending)
        self.pending_count = counts
