"""Suffix drafting (SuffixDecoding, Oliaro et al.): propose the most frequent continuation of the
longest suffix of a row's history that was seen before, in the row itself or in earlier requests.

Owns each row's committed history (prompt + committed tokens) with an index of its n0-grams
(n0 = min_match), and a corpus of earlier requests' sequences (`SuffixCorpus`: a row's prompt +
committed output when it leaves the batch, `keep_rows`), bounded by `max_corpus_tokens` and
evicted oldest request first. In `serve` one batch lives for the server's life, so the corpus
spans its requests; `start()` begins a new corpus unless `keep_corpus` (then the rows of the
batch before join it first: `--draft suffix` keeps it, so a process's earlier batches count too);
`clear_corpus()` forgets it and the rows running then. The tokens of a row's last pass are not in
it (a finishing row commits nothing to the drafter): at most k + 1 per request.

The lookup, per row and pass, as walking a suffix tree over the history and the corpus:
- the pattern: the longest suffix of the history (min_match..max_match tokens) that occurs
  earlier in the row or in the corpus. The index maps each n0-gram to the positions that follow
  it; up to `max_candidates` occurrences of the history's last n0-gram, most recent first (the
  row's own, then the corpus's), are extended backwards, and those with the longest match are
  the pattern's occurrences.
- the continuation: the next token is the one most of the occurrences continue with (ties: the
  most recent occurrence's), the occurrences that disagree are dropped, and the path's score is
  the product of the chosen fractions (the most frequent child, down the tree). The proposal
  stops before the score falls below `min_score`, at min(k, ceil(match_factor * match length))
  tokens (the draft length follows the match, as SuffixDecoding's max_spec_factor), or where no
  occurrence goes on. An occurrence in the row's own history that reaches the row's end continues
  with the proposal itself (the text as it would be once accepted: a cycle repeats).
Rows whose proposal is shorter than the batch's width are padded with the same walk continued
past its stopping rule, then the last token repeated; when no row proposes anything the
proposal is [B, 0] (a plain pass). Proposals are deterministic, so `draft_probs = None` (q
one-hot): the coupled rule keeps the output exact whatever is proposed. It knows nothing of
the vocabulary or of the sampling settings.

Cost: Python lists and dicts. A committed token costs one n0-gram tuple and a list append; a
request joins the corpus with its own index, one dict entry per distinct n0-gram in it, and
leaves it at the same cost. A lookup
costs at most max_candidates backward extensions (most stop at their first token) and a walk
of at most k steps over the surviving occurrences, whatever the history's or corpus's length.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from itertools import islice

import torch

from ..sampling import RowSampling


class _Row:
    """One row's committed tokens and its index n0-gram -> positions after it (ascending)."""

    __slots__ = ("tokens", "index")

    def __init__(self, tokens: Sequence[int], n0: int):
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens, n0)

    def extend(self, new: Sequence[int], n0: int) -> None:
        tokens, index = self.tokens, self.index
        for token in new:
            tokens.append(int(token))
            end = len(tokens)
            if end >= n0:
                index.setdefault(tuple(tokens[end - n0 :]), []).append(end)


class _Stored:
    """A sequence in the corpus: its tokens and index (a finished row's, taken over as they are)
    and, per n0-gram, the next older sequence holding it (None: none)."""

    __slots__ = ("tokens", "index", "older", "live")

    def __init__(self, row: _Row, older: dict):
        self.tokens, self.index, self.older, self.live = row.tokens, row.index, older, True


class SuffixCorpus:
    """Earlier requests' token sequences, at most `max_tokens` tokens, the oldest evicted first.

    An n0-gram's occurrences are a chain, newest sequence first: `newest[key]`, then each
    sequence's `older[key]`. Adding a sequence costs one step per distinct n0-gram in it and
    makes no container per n0-gram (so Python's garbage collector has little to scan); an
    evicted sequence is emptied and marked dead, and a chain ends at the first dead sequence
    (every one after it is older, so evicted too)."""

    def __init__(self, max_tokens: int, n0: int):
        self.max_tokens, self.n0 = max_tokens, n0
        self.sequences: deque[_Stored] = deque()  # oldest first
        self.newest: dict[tuple[int, ...], _Stored] = {}
        self.tokens = 0

    def add(self, row: _Row) -> None:
        """A finished request's tokens (its last max_tokens when longer); then the oldest leave."""
        if len(row.tokens) > self.max_tokens:
            row = _Row(row.tokens[len(row.tokens) - self.max_tokens :] if self.max_tokens else [], self.n0)
        if len(row.tokens) <= self.n0:  # no n0-gram with a token after it: nothing to propose from
            return
        newest, older = self.newest, {}
        stored = _Stored(row, older)
        for key in row.index:
            older[key] = newest.get(key)
            newest[key] = stored
        self.sequences.append(stored)
        self.tokens += len(row.tokens)
        while self.tokens > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        """Drop the oldest sequence: where it is an n0-gram's newest, no sequence holds that n0-gram."""
        stored = self.sequences.popleft()
        self.tokens -= len(stored.tokens)
        for key in stored.index:
            if self.newest.get(key) is stored:
                del self.newest[key]
        stored.tokens, stored.index, stored.older, stored.live = [], {}, {}, False

    def occurrences(self, key: tuple[int, ...], count: int) -> Iterator[tuple[list[int], int]]:
        """Up to `count` (sequence, position after `key`) with a token there, most recent first."""
        stored = self.newest.get(key)
        while stored is not None and stored.live and count > 0:
            tokens = stored.tokens
            for position in reversed(stored.index[key]):
                if position < len(tokens):
                    yield tokens, position
                    count -= 1
                    if not count:
                        return
            stored = stored.older[key]


def _positive_int(name: str, value: object, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


class SuffixDrafter:
    """Proposes the most frequent continuation of the longest earlier match of the row's suffix.

    min_match, max_match: the shortest and longest suffix matched (tokens); min_score: the
    proposal stops before its path's score (product of the chosen fractions) falls below it;
    match_factor: at most ceil(match_factor * match length) tokens are proposed; max_candidates:
    occurrences of the last min_match tokens examined per lookup (most recent first);
    max_corpus_tokens: the corpus's budget (0: no corpus, the row's own history only);
    keep_corpus: `start()` keeps the corpus (the previous batch's rows join it) instead of
    beginning a new one; device: where proposals are made (the target's device).
    """

    can_change_rows = True

    def __init__(
        self,
        min_match: int = 2,
        max_match: int = 32,
        min_score: float = 0.1,
        match_factor: float = 1.0,
        max_candidates: int = 64,
        max_corpus_tokens: int = 2**18,
        keep_corpus: bool = False,
        device: torch.device | str = "cpu",
    ):
        _positive_int("min_match", min_match, 1)
        _positive_int("max_match", max_match, min_match)
        _positive_int("max_candidates", max_candidates, 1)
        _positive_int("max_corpus_tokens", max_corpus_tokens, 0)
        if not (isinstance(min_score, (int, float)) and not isinstance(min_score, bool) and 0.0 <= min_score <= 1.0):
            raise ValueError(f"min_score must be a number in [0, 1], got {min_score!r}")
        if not (isinstance(match_factor, (int, float)) and not isinstance(match_factor, bool) and match_factor > 0):
            raise ValueError(f"match_factor must be a number > 0, got {match_factor!r}")
        self.min_match, self.max_match, self.min_score = min_match, max_match, float(min_score)
        self.match_factor, self.max_candidates = float(match_factor), max_candidates
        self.max_corpus_tokens, self.keep_corpus = max_corpus_tokens, keep_corpus
        self.device = torch.device(device)
        self.corpus = SuffixCorpus(max_corpus_tokens, min_match)
        self.rows: list[_Row] = []
        self._proposal: list[list[int]] = []  # the last proposal, row by row (width k')
        self._empty = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [B, 0]: nothing proposed
        self._seen: list[_Row] = []  # rows whose text came before the last clear_corpus: they never join it

    # ---- the batch's rows

    def start(self, prompts: list[list[int]], max_length: int) -> None:
        """Begin a batch: each row's history is its prompt; a new corpus unless keep_corpus."""
        if self.keep_corpus:
            for row in self.rows:
                self._join_corpus(row)
        else:
            self.corpus = SuffixCorpus(self.max_corpus_tokens, self.min_match)
        self.rows, self._seen = [_Row(p, self.min_match) for p in prompts], []
        self._proposal = [[] for _ in prompts]

    def keep_rows(self, rows: list[int]) -> None:
        """Rows leave (engine.Batch): only `rows` remain, in that order; the others join the corpus."""
        kept = set(rows)
        for number, row in enumerate(self.rows):
            if number not in kept:
                self._join_corpus(row)
        self.rows = [self.rows[r] for r in rows]
        self._proposal = [self._proposal[r] for r in rows] if self._proposal else []

    def reserve_row(self) -> None:
        return None  # nothing to read ahead: the history is the prompt

    def add_rows(self, prompts: list[list[int]], views: list | None = None) -> None:
        """New requests after the other rows: their histories are their prompts."""
        self.rows += [_Row(p, self.min_match) for p in prompts]
        self._proposal += [[] for _ in prompts]

    def clear_corpus(self) -> None:
        """Forget every earlier request (e.g. a server's synthetic calibration requests, or a benchmark's
        earlier round), the rows running now included: they will not join the new corpus when they leave."""
        self.corpus = SuffixCorpus(self.max_corpus_tokens, self.min_match)
        self._seen = list(self.rows)

    def _join_corpus(self, row: _Row) -> None:
        if not any(row is seen for seen in self._seen):
            self.corpus.add(row)

    def history(self, row: int) -> list[int]:
        """The committed tokens of one row (prompt + committed), as the drafter sees them."""
        return list(self.rows[row].tokens)

    # ---- proposing

    @torch.no_grad()
    def propose(self, k: int, sampling: RowSampling | None = None) -> tuple[torch.Tensor, None]:
        """draft_token_ids [B, k'] long (k' <= k: the longest row's proposal; 0 when no row
        proposes anything) and None: q is one-hot at the proposal."""
        walks, lengths = self._walks(k)
        width = max(lengths, default=0)
        self._proposal = [tokens[:width] for tokens in walks] if width else [[] for _ in self.rows]
        if not width:  # one empty tensor per batch size: a plain pass costs a small file ~2.5 ms, a new one 15 us
            if self._empty.shape[0] != len(self.rows):
                self._empty = torch.zeros(len(self.rows), 0, dtype=torch.long, device=self.device)
            return self._empty, None
        return torch.tensor(self._proposal, dtype=torch.long, device=self.device), None

    def confident(self, k: int) -> tuple[torch.Tensor, list[int]]:
        """For a combined draft (drafters/combined.py): every row's padded walk [B, k] and, per row, the length
        of its proposal (0 where the match or its score is too weak to propose anything)."""
        walks, lengths = self._walks(k)
        return torch.tensor(walks, dtype=torch.long, device=self.device).view(len(self.rows), k), lengths

    def _walks(self, k: int) -> tuple[list[list[int]], list[int]]:
        """Every row's padded walk (k tokens) and its proposal's length; none when k = 0."""
        walks = [self.walk(row, k) for row in self.rows] if k > 0 else []
        return [tokens for tokens, _ in walks], [length for _, length in walks]

    def take(self, proposal: torch.Tensor) -> None:
        """What this pass proposed [B, k'] when another drafter chose it: commit() appends from it."""
        self._proposal = proposal.tolist()

    def match(self, row: _Row) -> tuple[int, list[tuple[list[int], int]]]:
        """The longest match length and its occurrences (sequence, position after the match),
        most recent first (the row's own, then the corpus's); (0, []) when nothing matches."""
        history, n0 = row.tokens, self.min_match
        length = len(history)
        if length < n0:
            return 0, []
        key = tuple(history[length - n0 :])
        own = row.index.get(key, [])  # its last entry is the suffix itself (position == length)
        candidates = [(history, p) for p in islice(reversed(own), 1, self.max_candidates + 1)]
        candidates += self.corpus.occurrences(key, self.max_candidates - len(candidates))
        best, occurrences = 0, []
        for sequence, position in candidates:
            matched, stop = n0, min(self.max_match, position, length)
            while matched < stop and sequence[position - 1 - matched] == history[length - 1 - matched]:
                matched += 1
            if matched > best:
                best, occurrences = matched, [(sequence, position)]
            elif matched == best:
                occurrences.append((sequence, position))
        return best, occurrences

    def walk(self, row: _Row, k: int) -> tuple[list[int], int]:
        """The row's k tokens (the proposal, then its padding) and the proposal's length."""
        history = row.tokens
        matched, occurrences = self.match(row)
        limit = min(k, math.ceil(self.match_factor * matched))
        tokens: list[int] = []
        length, score = None, 1.0  # length: set once the stopping rule fires
        end = len(history)
        while occurrences and len(tokens) < k:
            following = []  # (next token, sequence, position) for the occurrences that go on
            for sequence, position in occurrences:
                if sequence is history:  # the row's own text, continued by the proposal itself
                    following.append(
                        (history[position] if position < end else tokens[position - end], history, position)
                    )
                elif position < len(sequence):
                    following.append((sequence[position], sequence, position))
            if not following:
                break
            counts: dict[int, int] = {}
            for token, _, _ in following:  # insertion order is recency: ties go to the most recent
                counts[token] = counts.get(token, 0) + 1
            token = max(counts, key=counts.__getitem__)
            if length is None:
                score *= counts[token] / len(following)
                if len(tokens) >= limit or score < self.min_score:
                    length = len(tokens)
            tokens.append(token)
            occurrences = [(sequence, position + 1) for chosen, sequence, position in following if chosen == token]
        if length is None:
            length = min(len(tokens), limit)
        last = tokens[-1] if tokens else history[-1]
        return tokens + [last] * (k - len(tokens)), length

    def commit(self, num_accepted: list[int], next_token_ids: torch.Tensor, active: list[bool]) -> None:
        """Append each active row's accepted proposals and next token [B]; inactive rows stay."""
        if not any(active):
            return
        following = next_token_ids.tolist()
        for row, proposal, accepted, token, live in zip(self.rows, self._proposal, num_accepted, following, active):
            if live:
                row.extend([*proposal[:accepted], token], self.min_match)

    # ---- plan's teacher-forced replay

    def replay(self, sequences: Sequence[Sequence[int]], starts: Sequence[int], k: int):
        """Per sequence, the padded proposal [T, k] long from each prefix sequence[:t], t = start..end-1,
        and its length [T] long (0: nothing proposed, a plain pass). A new corpus first; with
        keep_corpus each sequence then joins it, as requests served one after another."""
        self.clear_corpus()
        results = []
        for sequence, start in zip(sequences, starts):
            row, proposals, lengths = _Row(sequence[:start], self.min_match), [], []
            for token in sequence[start:]:
                tokens, length = self.walk(row, k)
                proposals.append(tokens)
                lengths.append(length)
                row.extend([token], self.min_match)
            if self.keep_corpus:
                self.corpus.add(row)
            results.append(
                (torch.tensor(proposals, dtype=torch.long).reshape(-1, k), torch.tensor(lengths, dtype=torch.long))
            )
        return results
