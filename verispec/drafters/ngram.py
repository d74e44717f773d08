"""Prompt lookup (n-gram) drafting: propose what followed the last n tokens the last time.

Owns each row's committed history (prompt + committed tokens) as a token tensor
`[B, capacity]` with per-row lengths, and the lookup: the proposal continues the LATEST
earlier occurrence of the row's last n tokens, trying n = max_ngram down to min_ngram
(transformers' prompt lookup decoding, `prompt_lookup_num_tokens`; n-gram speculation in
llama.cpp and vLLM). It runs no model and does not know the vocabulary or the sampling
settings: its proposals are deterministic, so it declares `draft_probs = None` (q one-hot
at the proposal), which keeps the accept-reject rule exact whatever it proposes.

Padding (a proposal is always `[B, k]` and deterministic): the proposal is the history
continued with period d = (row length) - (position after the match), i.e. as if the text
kept repeating from the matched occurrence. When the match has k or more following tokens
this is exactly the continuation; when it has fewer, the copy runs on into the proposal
itself (a cycle such as "a b c a b" proposes "c a b c ..."). A row with no match is padded
with its last token repeated (d = 1). When no row has a match, it proposes nothing (a
`[B, 0]` proposal: the engine then runs a plain step, one position instead of k + 1), as
transformers' prompt lookup does.

Cost: one vectorised comparison of every window of the history against the suffix per n,
O(history * max_ngram) per row and step; the tensor work has no Python loop over rows or
positions and one host synchronisation (whether any row matched; a host list of row lengths
is kept up to date from the `num_accepted` list the engine passes). The history is a tensor rather than Python
lists so that batches of 10^5 rows (the statistical tests) cost little; keep it on the
target's device (`device=`), or each commit copies next_token_ids across.
"""

from __future__ import annotations

import itertools

import torch

from ..sampling import RowSampling


class PromptLookupDrafter:
    """Proposes the continuation of the latest earlier occurrence of the last n tokens.

    max_ngram, min_ngram: the longest and shortest suffix looked up (longest first);
    device: where the history tensor lives (the target's device).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, device: torch.device | str = "cpu"):
        for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if max_ngram < min_ngram:
            raise ValueError(f"max_ngram must be >= min_ngram ({min_ngram}), got {max_ngram!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.device = torch.device(device)
        self.tokens: torch.Tensor | None = None  # [B, capacity] long; row b is valid up to lengths[b]
        self.host_lengths: list[int] = []

    def start(self, prompts: list[list[int]], max_length: int) -> None:
        self.host_lengths = [len(p) for p in prompts]
        self.lengths = torch.tensor(self.host_lengths, dtype=torch.long, device=self.device)  # [B]
        capacity = max(max_length, max(self.host_lengths))
        self.tokens = torch.zeros(len(prompts), capacity, dtype=torch.long, device=self.device)  # [B, capacity]
        flat = torch.tensor(list(itertools.chain.from_iterable(prompts)), dtype=torch.long, device=self.device)
        rows = torch.repeat_interleave(torch.arange(len(prompts), device=self.device), self.lengths)  # [sum len]
        columns = torch.arange(flat.numel(), device=self.device) - (self.lengths.cumsum(0) - self.lengths)[rows]
        self.tokens[rows, columns] = flat
        self._k, self._proposal = 0, self.tokens.new_zeros(len(prompts), 0)

    can_change_rows = True

    def keep_rows(self, rows: list[int]) -> None:
        """Rows leave (engine.Batch): only `rows` remain, in that order."""
        assert self.tokens is not None, "start() first"
        self.tokens = self.tokens.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.device))
        self.host_lengths = [self.host_lengths[r] for r in rows]
        self.lengths = torch.tensor(self.host_lengths, dtype=torch.long, device=self.device)

    def reserve_row(self) -> None:
        return None  # nothing to read ahead: the history is the prompt

    def add_rows(self, prompts: list[list[int]], views: list | None = None) -> None:
        """New requests after the other rows: their histories are their prompts."""
        assert self.tokens is not None, "start() first"
        width = max(self.tokens.shape[1], max(len(p) for p in prompts))
        new = self.tokens.new_zeros(len(prompts), width)
        for row, prompt in enumerate(prompts):
            new[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=self.device)
        if width > self.tokens.shape[1]:
            self.tokens = torch.cat(
                [self.tokens, self.tokens.new_zeros(self.tokens.shape[0], width - self.tokens.shape[1])], dim=1
            )
        self.tokens = torch.cat([self.tokens, new])
        self.host_lengths = self.host_lengths + [len(p) for p in prompts]
        self.lengths = torch.tensor(self.host_lengths, dtype=torch.long, device=self.device)

    def history(self, row: int) -> list[int]:
        """The committed tokens of one row (prompt + committed), as the drafter sees them."""
        assert self.tokens is not None, "start() first"
        return self.tokens[row, : self.host_lengths[row]].tolist()

    @torch.no_grad()
    def propose(self, k: int, sampling: RowSampling) -> tuple[torch.Tensor, None]:
        """draft_token_ids [B, k], or [B, 0] when no row matched (long), and None: q is one-hot."""
        assert self.tokens is not None, "start() first"
        proposal = self.tokens[:, :0]
        if k > 0:
            proposal, found = self.lookup(k)
            if not bool(found.any()):  # nothing to copy anywhere: a plain step is cheaper
                proposal = proposal[:, :0]
        self._proposal, self._k = proposal, proposal.shape[1]
        return proposal, None

    def confident(self, k: int) -> tuple[torch.Tensor, list[int]]:
        """For a combined draft (drafters/combined.py): every row's proposal [B, k] and, per row, how many of
        its tokens the lookup stands behind: k where the row's suffix occurred earlier, else 0."""
        proposal, found = self.lookup(k)
        return proposal, [k if hit else 0 for hit in found.tolist()]

    def take(self, proposal: torch.Tensor) -> None:
        """What this pass proposed [B, k'] when another drafter chose it: commit() appends from it."""
        self._proposal, self._k = proposal, proposal.shape[1]

    def lookup(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's padded proposal [B, k] and whether the row matched [B] bool."""
        width = max(self.host_lengths)
        history, lengths = self.tokens[:, :width], self.lengths  # [B, W], [B]
        follow = lengths - 1  # position whose token comes next; no match: repeat the last token
        found = torch.zeros_like(lengths, dtype=torch.bool)  # [B]
        for n in range(min(self.max_ngram, width - 1), self.min_ngram - 1, -1):
            suffix_at = (lengths[:, None] - n + torch.arange(n, device=self.device)).clamp_min(0)  # [B, n]
            suffix = history.gather(1, suffix_at)  # [B, n]
            windows = history.unfold(1, n, 1)  # [B, W-n+1, n]: windows[b, s] = history[b, s:s+n]
            starts = torch.arange(windows.shape[1], device=self.device)  # [W-n+1]
            # an EARLIER occurrence ends before the last token: s + n <= length - 1
            match = (windows == suffix[:, None]).all(-1) & (starts <= (lengths - n - 1)[:, None])  # [B, W-n+1]
            latest = torch.where(match, starts, -1).amax(dim=1)  # [B], -1: none
            hit = ~found & (latest >= 0)
            follow = torch.where(hit, latest + n, follow)
            found |= hit
        period = lengths - follow  # >= 1
        offsets = torch.arange(k, device=self.device)[None] % period[:, None]  # [B, k]
        return history.gather(1, follow[:, None] + offsets), found  # [B, k], [B]

    def commit(self, num_accepted: list[int], next_token_ids: torch.Tensor, active: list[bool]) -> None:
        """Append each active row's accepted proposals and next token [B]; inactive rows stay."""
        assert self.tokens is not None, "start() first"
        k, batch = self._k, len(active)
        if not any(active):
            return
        needed = max(n + k + 1 for n, live in zip(self.host_lengths, active) if live)
        if needed > self.tokens.shape[1]:  # grow (rare: the engine sizes max_length for its k)
            self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(batch, needed - self.tokens.shape[1])], dim=1)
        live = torch.tensor(active, device=self.device)  # [B]
        accepted = torch.tensor(num_accepted, dtype=torch.long, device=self.device)  # [B]
        lengths = torch.where(live, self.lengths, 0)  # inactive rows write their own tokens back at 0..
        # all k proposals, then the next token over the first rejected one; beyond the new length is stale
        at = lengths[:, None] + torch.arange(k + 1, device=self.device)  # [B, k+1]
        written = torch.cat([self._proposal, self._proposal.new_zeros(batch, 1)], dim=1)
        written = written.scatter(1, accepted[:, None], next_token_ids.to(self.device, torch.long)[:, None])
        self.tokens.scatter_(1, at, torch.where(live[:, None], written, self.tokens.gather(1, at)))
        self.lengths = torch.where(live, self.lengths + accepted + 1, self.lengths)
        self.host_lengths = [n + a + 1 if on else n for n, a, on in zip(self.host_lengths, num_accepted, active)]
