"""One llama.cpp context and the cache over it: KV memory, batches, placeholders.

Owns `Context` (a llama_context for n_seq sequences and its llama_batch, filled through numpy
views; `decode` runs tokens at positions of sequences and reads the logits in place) and
`LlamaCppCache` (verispec's cache contract over a context: per-row lengths, rollback, rows that
leave and join). The placeholder rules live here: a shape-invariant context adds a placeholder
token after a one-token pass (`Context.single_pad`), gives every sequence of a pass at least two
tokens and fills the gaps between them (`Context.fill_gaps`), so that a position's logits do not
depend on the pass.

Cache contract (the same as `KVCache`'s). A cache owns one llama.cpp context; row b is llama.cpp
sequence seqs[b]. A forward of T tokens is one `llama_decode` of B*T tokens (sequence b at
positions lengths[b] .. lengths[b]+T-1) and advances every length by T. `rollback(lengths)`
removes each row's positions from its new length on (`llama_memory_seq_rm`), so the next forward
writes them afresh. Knows nothing of files, tokenizers, sampling or speculation.
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..models.cache import CacheLengths
from .head import new_head
from .lib import library, log_tail

N_BATCH = 512  # tokens per llama_decode call at least (a longer prefill is split); llama.cpp's ubatch
_TOKENS_PER_ROW = (
    9  # a context takes B * 9 tokens per llama_decode (a verification of k = 8 for every row) when that is more
)
_UBATCH_POSITIONS = 6  # a ubatch's pass over the weights costs about this many positions of compute (a one-row pass of
#                       the built-in target costs about as much as 6 more positions in it)
TILED_FROM = 64  # flash attention's tiled kernel takes a sequence's queries from 64 a ubatch on (ggml's GGML_FA_TILE_Q)
PROMPT_BLOCK = 256  # under flash attention a prompt is written in passes cut at multiples of this position
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: rows of one cache
KV_TYPES = {"f16": 1, "f32": 0}  # GGML_TYPE_F16, GGML_TYPE_F32
SPLIT_KV_FROM = 240  # flash attention splits the cells of one query of one sequence over the threads once a pass reads
#                     512 cells: llama.cpp pads the cells read to 256, so from position 256 on (a margin below it)


def _cells(n_seq: int, n_ctx_seq: int, capacity: int) -> int:
    """A context's n_ctx. llama.cpp caps a batch (and a ubatch) at n_ctx: a context of fewer cells
    than `capacity` would cut a prompt into smaller passes than a larger context does, and where a
    prompt's passes are cut changes its cells (flash attention's tiled kernel from 64 queries on,
    sgemm's attention for one query): every context takes `capacity` tokens a decode, so that a
    prompt's passes never depend on the cache it is written into (a spare context is reused)."""
    return max(n_seq * n_ctx_seq, capacity)


class ContextOwner(Protocol):
    """What a context reads of its model (model.LlamaCppModel keeps it)."""

    weights: object  # the loaded llama_model (`handle`); the context holds it, so it is freed after the context
    path: Path
    n_threads: int
    kv_type: str  # a key of KV_TYPES
    shape_invariant: bool  # placeholders: a position's logits do not depend on the pass
    flash_attention: bool  # with shape_invariant: flash attention, not sgemm's (see Context)
    sgemm_weights: bool  # a matrix of the file takes llamafile's sgemm from 2 columns on (one column: vec_dot)
    vocab_size: int

    def release_context(self, context: Context) -> None:
        """A cache is gone: its context may be kept for the next cache."""


def _by_sequence(seqs: np.ndarray) -> np.ndarray | None:
    """The stable order that sorts a batch's tokens by sequence id, or None when they are sorted.

    With one KV stream per sequence (llama.cpp's default, `kv_unified` off) llama.cpp cuts a
    batch into ubatches of sequences whose ids rise by one in batch order, and each ubatch reads
    every weight: sequences [3, 1, 2, 0] run as three passes over the weights, [0, 1, 2, 3] as
    one. Rows join on the lowest free sequences (`LlamaCppCache.add_rows`), so sorted, a server's
    batch is one ubatch unless a row left a gap that no row has filled yet."""
    if len(seqs) < 2 or bool((seqs[1:] >= seqs[:-1]).all()):
        return None
    return np.argsort(seqs, kind="stable")


def _ubatches(counts: np.ndarray, n_ubatch: int) -> int:
    """How many ubatches llama.cpp's split_equal makes of a batch sorted by sequence, with
    counts[i] tokens on the i-th sequence of a range (0: not in the batch): each takes the
    lowest run of consecutive sequences with tokens left, and from each the fewest any has left."""
    left, ubatches = counts.astype(np.int64).copy(), 0
    while left.any():
        start = int(np.flatnonzero(left)[0])
        stop = start + (int(np.flatnonzero(left[start:] == 0)[0]) if (left[start:] == 0).any() else len(left) - start)
        left[start:stop] -= min(int(left[start:stop].min()), max(n_ubatch // (stop - start), 1))
        ubatches += 1
    return ubatches


class Context:
    """One llama.cpp context: its KV memory for n_seq sequences of up to n_ctx_seq positions, and
    a llama_batch of n_batch = max(N_BATCH, 9 n_seq) tokens with numpy views on its arrays
    (filled without a copy). llama.cpp runs a batch in ubatches of N_BATCH."""

    def __init__(self, model: ContextOwner, n_seq: int, n_ctx_seq: int):
        lib = library()
        params = lib.llama_context_default_params()
        self.flash = model.shape_invariant and model.flash_attention
        self.lone_pad = self.flash and model.sgemm_weights  # every pass of one position gets a placeholder
        # flash attention over dot-product weights: a one-token pass past SPLIT_KV_FROM puts its placeholder in a
        # sequence of its own (`spare_seq`, after the rows), where it attends to its one cell instead of them all
        spare = self.flash and not self.lone_pad and n_seq < MAX_SEQUENCES
        self.spare_seq = n_seq if spare else None
        params.n_seq_max = n_seq + spare
        # one row and the spare: one KV stream for both (the placeholder a second query of the row's stream, masked
        # to its own cell), so that the row's heads and the placeholder's interleave in flash attention's chunks of
        # rows (queries x heads) and the threads share the row's heads evenly; with a stream each, the row's heads
        # form one run of chunks (SmolLM2's 9 heads: 6 on one thread, 3 on the other). The row keeps a cell of
        # room for the placeholder (`n_ctx_seq`).
        self.unified = bool(spare) and n_seq == 1
        params.kv_unified = self.unified
        capacity = max(N_BATCH, _TOKENS_PER_ROW * n_seq)
        params.n_ctx = _cells(n_seq + (spare and not self.unified), n_ctx_seq + self.unified, capacity)
        params.n_batch, params.n_ubatch = capacity, N_BATCH
        params.n_threads = params.n_threads_batch = model.n_threads
        params.no_perf = True
        params.type_k = params.type_v = KV_TYPES[model.kv_type]
        # two shape-invariant regimes (docs/EXACTNESS.md). sgemm's attention (flash attention off, as llama-cpp-python's
        # Llama): two matrix products in the cache's type, llamafile's sgemm from 2 queries per sequence on, so no
        # sequence of a pass has one token (placeholders).
        # Flash attention: each query on its own, so a one-token pass needs no placeholder until flash attention would
        # split its cells (SPLIT_KV_FROM), unless a matrix of the file takes sgemm (the pass's only position: vec_dot)
        # verispec's own output head (head.py) where only the head keeps the file's matrices from vec_dot at every
        # width: the graph stops after the final norm, and a decode is one ubatch (its outputs in batch order)
        self.head = new_head(model, capacity, model.n_threads) if getattr(model, "own_head", False) else None
        if self.head is not None:
            params.cb_eval, params.cb_eval_user_data = self.head.eval_callback, self.head.user_data
            params.n_ubatch = capacity
        params.flash_attn_type = 1 if self.flash else 0
        params.swa_full = True  # sliding-window layers keep every cell: a rollback finds what the window reads again
        self.weights = model.weights  # freed after this context
        self.ptr = lib.llama_init_from_model(model.weights.handle, params)
        if not self.ptr:
            raise RuntimeError(
                f"{model.path}: llama.cpp could not create a context for {n_seq} x {n_ctx_seq} positions: {log_tail()}"
            )
        self.n_seq, self.n_ctx_seq = n_seq, lib.llama_n_ctx_seq(self.ptr) - self.unified
        self.n_batch = min(capacity, lib.llama_n_batch(self.ptr))  # llama.cpp caps it at n_ctx
        self.memory = lib.llama_get_memory(self.ptr)
        self.batch = lib.llama_batch_init(capacity, 0, 1)
        self.token = np.ctypeslib.as_array(self.batch.token, shape=(capacity,))
        self.pos = np.ctypeslib.as_array(self.batch.pos, shape=(capacity,))
        self.output = np.ctypeslib.as_array(self.batch.logits, shape=(capacity,))
        np.ctypeslib.as_array(self.batch.n_seq_id, shape=(capacity,))[:] = 1
        self._seq_ids = [self.batch.seq_id[i] for i in range(capacity)]
        self._seq_written = np.full(capacity, -1)  # what seq_id[i][0] holds now (skip rewriting it)
        self._lib, self.vocab_size = lib, model.vocab_size
        self.invariant = model.shape_invariant  # no sequence of one token in a pass; gaps always filled
        self._logits_view, self._logits_address = np.empty((0, self.vocab_size), np.float32), None

    def decode(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        seqs: np.ndarray,
        outputs: np.ndarray | bool,
        read: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> tuple[np.ndarray | None, float]:
        """Run tokens [N] at positions [N] of sequences [N], with logits where outputs [N] (or one
        bool for all): (read(logits [n, V]) of each llama_decode, concatenated, or None without
        read; seconds spent inside llama_decode). read sees llama.cpp's own buffer in place (a
        view, reused by the next decode): it returns a copy or a reduction of it."""
        if self.flash and len(tokens) >= TILED_FROM and np.unique(seqs, return_counts=True)[1].max() >= TILED_FROM:
            return self._in_blocks(tokens, positions, seqs, outputs, read)  # a prompt: `_in_blocks`
        return self._decode(tokens, positions, seqs, outputs, read)

    def _decode(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        seqs: np.ndarray,
        outputs: np.ndarray | bool,
        read: Callable[[np.ndarray], np.ndarray] | None,
    ) -> tuple[np.ndarray | None, float]:
        lib, results, inside = library(), [], 0.0
        given = tokens, positions, seqs, outputs
        pad = self._single_pad(tokens, positions, seqs, outputs)
        if pad is not None:  # one sequence, one token or one output: a second, with logits, after it,
            pad_seq, pad_logits = int(seqs[-1]), True
            if self._in_spare(tokens, seqs):  # or in the next sequence, empty, at its start, without logits (no
                pad, pad_seq, pad_logits = 0, pad_seq + 1, False  # kernel of this regime depends on the outputs' count)
            outputs = np.concatenate(
                [np.full(len(tokens), outputs) if isinstance(outputs, bool) else outputs, [pad_logits]]
            )
            tokens, positions, seqs = (
                np.append(tokens, tokens[-1]),
                np.append(positions, pad),
                np.append(seqs, pad_seq),
            )
        filled = self._fill_gaps(seqs, positions, always=self.invariant)
        if filled is not None:  # placeholders: every sequence in the range with as many tokens, one ubatch
            pads, pad_positions = filled
            outputs = np.concatenate(
                [np.full(len(tokens), outputs) if isinstance(outputs, bool) else outputs, np.zeros(len(pads), bool)]
            )
            tokens = np.concatenate([tokens, np.zeros(len(pads), tokens.dtype)])
            positions, seqs = np.concatenate([positions, pad_positions]), np.concatenate([seqs, pads])
        order = _by_sequence(seqs)
        if order is not None:  # llama.cpp's ubatches take runs of consecutive sequence ids in batch order
            tokens, positions, seqs = tokens[order], positions[order], seqs[order]
            if not isinstance(outputs, bool):
                outputs = outputs[order]
        if self.head is not None and not self._one_ubatch(seqs):  # the head's rows would not be in batch order
            return self._in_blocks(*given, read)
        for start in range(0, len(tokens), self.n_batch):
            end = min(start + self.n_batch, len(tokens))
            count = end - start
            self.token[:count] = tokens[start:end]
            self.pos[:count] = positions[start:end]
            self.output[:count] = outputs if isinstance(outputs, bool) else outputs[start:end]
            for i in np.flatnonzero(self._seq_written[:count] != seqs[start:end]):
                self._seq_ids[i][0] = int(seqs[start + i])
            self._seq_written[:count] = seqs[start:end]
            self.batch.n_tokens = count
            if self.head is not None:
                self.head.reset()
            started = time.perf_counter()
            status = lib.llama_decode(self.ptr, self.batch)
            inside += time.perf_counter() - started
            if status != 0:
                raise RuntimeError(f"llama_decode failed (status {status}): {log_tail()}")
            if read is not None:
                rows = count if isinstance(outputs, bool) else int(np.count_nonzero(outputs[start:end]))
                results.append(read(self.logits(rows) if self.head is None else self.head.logits(rows)))
        if filled is not None:  # the placeholders' cells go: each sequence is as it was, plus its tokens
            pads, pad_positions = filled
            first = np.flatnonzero(np.r_[True, pads[1:] != pads[:-1]])  # each padded sequence's first placeholder
            for seq, position in zip(pads[first], pad_positions[first]):
                lib.llama_memory_seq_rm(self.memory, int(seq), int(position), -1)
        if pad is not None:
            lib.llama_memory_seq_rm(self.memory, pad_seq, int(pad), -1)
        if read is None:
            return None, inside
        found = np.concatenate(results) if len(results) > 1 else results[0]
        if pad is not None and pad_logits:
            found = found[:-1]  # the placeholder's row (one sequence: it is the last)
        if order is not None:  # back to the caller's order of output tokens
            found = found[np.argsort(order if isinstance(outputs, bool) else order[outputs])]
        return found, inside

    def _in_blocks(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        seqs: np.ndarray,
        outputs: np.ndarray | bool,
        read: Callable[[np.ndarray], np.ndarray] | None,
    ) -> tuple[np.ndarray | None, float]:
        """`decode` one sequence at a time, in the order of their first tokens, each cut where its
        positions cross a multiple of PROMPT_BLOCK. Under flash attention a sequence of 64 queries
        or more in a ubatch takes the tiled kernel, whose results depend on how the ubatch was cut
        (padded to another row's length, split where the batch reaches n_batch, or a prompt read
        piece by piece by a server): each prompt then got other cells than alone and whole. Cut at
        fixed positions, its passes depend on its own tokens only, whether it is written at once
        or in pieces of a multiple of PROMPT_BLOCK (a server's --prefill-chunk, 256 by default)."""
        flags = np.full(len(tokens), outputs) if isinstance(outputs, bool) else np.asarray(outputs)
        found, order, inside = [], [], 0.0
        for seq in seqs[np.sort(np.unique(seqs, return_index=True)[1])]:
            mine = np.flatnonzero(seqs == seq)
            blocks = positions[mine] // PROMPT_BLOCK
            for block in blocks[np.sort(np.unique(blocks, return_index=True)[1])]:
                at = mine[blocks == block]
                result, seconds = self._decode(tokens[at], positions[at], seqs[at], flags[at], read)
                inside += seconds
                if result is not None:
                    found.append(result)
                    order.append(at[flags[at]])
        if read is None:
            return None, inside
        return np.concatenate(found)[np.argsort(np.concatenate(order))], inside

    def _one_ubatch(self, seqs: np.ndarray) -> bool:
        """Whether llama.cpp runs each decode of these (sorted) sequences as one ubatch, so that its
        outputs come in batch order: one sequence, or consecutive ones with as many tokens each."""
        present, counts = np.unique(seqs, return_counts=True)
        if len(present) == 1:
            return True
        consecutive = int(present[-1] - present[0]) + 1 == len(present)
        return consecutive and int(counts.min()) == int(counts.max()) and len(seqs) <= self.n_batch

    def _single_pad(
        self, tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray, outputs: np.ndarray | bool
    ) -> int | None:
        """The position of a placeholder token that a shape-invariant pass adds, or None: a pass of
        one sequence with one token, or with logits at one position only, would run llama.cpp's
        one-column kernels (llamafile's sgemm takes 2 columns or more; attention's products take
        one query per sequence; the last layer and the output head run on the positions with
        logits); with flash attention, only its split over threads from SPLIT_KV_FROM on (and the
        one-column kernels where a matrix of the file takes sgemm: `lone_pad`). The placeholder
        follows the sequence's last token, with logits (`_in_spare`: in the next sequence, without),
        in the same llama_decode; its cell is removed after."""
        if not self.invariant or not 0 < len(tokens) < self.n_batch or not (seqs == seqs[0]).all():
            return None
        wanted = len(tokens) if outputs is True else 0 if outputs is False else int(np.count_nonzero(outputs))
        if len(tokens) > 1 and wanted != 1:
            return None
        position = int(positions.max()) + 1
        if self.flash and not self.lone_pad and position <= SPLIT_KV_FROM:
            return None
        return position if position < self.n_ctx_seq else None

    def _in_spare(self, tokens: np.ndarray, seqs: np.ndarray) -> bool:
        """Whether a one-token pass's placeholder goes to the sequence after the row's: under flash attention
        over dot-product weights (its placeholder only keeps flash attention from splitting the query's cells,
        which ggml does for one query of one KV stream), where that sequence is the spare (the row is the
        last) or a free one, empty (a server's slot; llama.cpp puts consecutive sequence ids with equal counts
        in one ubatch). The row's logits are those of a pass of several of its positions, bit for bit
        (benchmarks/spare_sequence_probe.py)."""
        if self.spare_seq is None or len(tokens) != 1 or int(seqs[0]) >= self.spare_seq:
            return False
        after = int(seqs[0]) + 1
        return after == self.spare_seq or self._lib.llama_memory_seq_pos_max(self.memory, after) < 0

    def _fill_gaps(
        self, seqs: np.ndarray, positions: np.ndarray, always: bool = False
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(sequences, positions) of placeholder tokens that give every sequence from the batch's
        lowest to its highest the same number of tokens (at least 2 with `always` under sgemm's
        attention: its products of one query per sequence take other kernels), or None where they would not pay.
        With one KV stream per sequence llama.cpp cuts a batch into ubatches of consecutive
        sequence ids that each take the same number of tokens from every one of them
        (split_equal), and each ubatch reads every weight: a row that finished left a gap in a
        server's sequences until a new row filled it (a pass then runs as several ubatches, each
        reading every weight), and a gap filled with one token still cut a verification of 2 tokens
        a row in three, as rows with 1 and 2 pending tokens cut a draft's pass in two. The placeholders go after
        each sequence's last cell (after its tokens in this batch), and their cells are removed
        after the decode (`decode`). Padded where that costs fewer positions than the ubatches it
        saves (`_UBATCH_POSITIONS` each): a decode pass, not a prefill of prompts of different lengths."""
        present, counts = np.unique(seqs, return_counts=True)
        lo, hi, most = int(present[0]), int(present[-1]), max(int(counts.max()), 2 if always and not self.flash else 1)
        if hi - lo + 1 == len(present) and int(counts.min()) == most:
            return None
        full = np.zeros(hi - lo + 1, dtype=np.int64)
        full[present - lo] = counts
        padded = len(full) * most
        pays = padded + _UBATCH_POSITIONS < int(full.sum()) + _UBATCH_POSITIONS * _ubatches(full, N_BATCH)
        if padded > N_BATCH or not (pays or always):  # a shape-invariant pass is one ubatch whatever it costs
            return None
        ends = np.full(len(full), -1, dtype=np.int64)  # each sequence's next position
        np.maximum.at(ends, seqs - lo, positions)
        pos_max = self._lib.llama_memory_seq_pos_max
        for i in np.flatnonzero(full == 0):  # a sequence not in the batch: after its last cell
            ends[i] = pos_max(self.memory, lo + int(i))
        ends += 1
        if int((ends + most - full).max()) > self.n_ctx_seq:
            return None
        pad = most - full
        pad_seqs = np.repeat(np.arange(lo, hi + 1), pad)
        pad_positions = np.concatenate([np.arange(end, end + n) for end, n in zip(ends, pad)])
        return pad_seqs.astype(seqs.dtype), pad_positions.astype(np.int64)

    def logits(self, rows: int) -> np.ndarray:
        """llama.cpp's logits of the last decode, [rows, V] float32 in place (no copy)."""
        pointer = self._lib.llama_get_logits(self.ptr)
        address = ctypes.cast(pointer, ctypes.c_void_p).value
        if address != self._logits_address or rows > len(self._logits_view):  # llama.cpp grew its buffer
            self._logits_view = np.ctypeslib.as_array(pointer, shape=(rows, self.vocab_size))
            self._logits_address = address
        return self._logits_view[:rows]

    def free(self) -> None:
        if self.ptr:
            lib = library()
            lib.llama_batch_free(self.batch)
            lib.llama_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:
        if not sys.is_finalizing():
            self.free()


class LlamaCppCache(CacheLengths):
    """Per-row lengths over one llama.cpp context (row b is sequence seqs[b]: b, until rows leave
    and join); rollback removes positions. The lengths live on the host only (`lengths` is made
    from them when asked for)."""

    def __init__(self, model: ContextOwner, context: Context, batch_size: int, max_length: int):
        self.max_length, self._host_lengths = max_length, [0] * batch_size
        self.model, self.context = model, context
        self.seqs = list(range(batch_size))  # row -> llama.cpp sequence id

    @property
    def lengths(self) -> torch.Tensor:  # [B]
        return torch.tensor(self._host_lengths, dtype=torch.long)

    @property
    def batch_size(self) -> int:
        return len(self._host_lengths)

    def advance(self, num_tokens: int) -> None:
        self._host_lengths = [n + num_tokens for n in self._host_lengths]

    def rollback(self, lengths: list[int]) -> None:
        """Keep the first lengths[b] positions of row b; llama.cpp forgets the rest."""
        self.check_rollback(lengths)
        before = self._host_lengths
        for seq, old, new in zip(self.seqs, before, lengths):
            if new < old and not library().llama_memory_seq_rm(self.context.memory, seq, new, -1):
                raise RuntimeError(f"llama.cpp could not roll sequence {seq} back from {old} to {new} positions")
        self._host_lengths = list(lengths)

    def keep_rows(self, rows: list[int]) -> None:
        """Rows leave: their sequences are emptied and free; the others keep theirs (no copy)."""
        kept = [self.seqs[r] for r in rows]
        self._keep_lengths(rows)
        for seq in set(self.seqs) - set(kept):
            library().llama_memory_seq_rm(self.context.memory, seq, 0, -1)
        self.seqs = kept

    def reserve_row(self) -> LlamaCppCache:
        """A one-row cache on a free sequence, for a prompt prefilled piece by piece before its
        request joins (`adopt_row`: the batch's last row, nothing copied; `release_row`)."""
        self._reserved = getattr(self, "_reserved", set())
        free = sorted(set(range(self.context.n_seq)) - set(self.seqs) - self._reserved)
        if not free:
            raise ValueError(f"the llama.cpp context holds {self.context.n_seq} sequences; none is free to reserve")
        seq = free[0]  # the lowest, as for a join: the batch's sequence ids stay consecutive (_by_sequence)
        library().llama_memory_seq_rm(self.context.memory, seq, 0, -1)
        view = LlamaCppCache.__new__(LlamaCppCache)
        view.max_length, view._host_lengths, view.model, view.context, view.seqs = (
            self.max_length,
            [0],
            self.model,
            self.context,
            [seq],
        )
        view._view = True  # shares the context: never hands it back
        self._reserved.add(seq)
        return view

    def adopt_row(self, view: LlamaCppCache) -> None:
        self._reserved.discard(view.seqs[0])
        self.seqs = self.seqs + view.seqs
        self._host_lengths = self._host_lengths + view.host_lengths

    def release_row(self, view: LlamaCppCache) -> None:
        self._reserved.discard(view.seqs[0])
        library().llama_memory_seq_rm(self.context.memory, view.seqs[0], 0, -1)

    def add_rows(self, count: int) -> None:
        """Rows join on free sequences of the context (empty: emptied when their rows left)."""
        free = sorted(set(range(self.context.n_seq)) - set(self.seqs) - getattr(self, "_reserved", set()))
        if count > len(free):
            raise ValueError(
                f"the llama.cpp context holds {self.context.n_seq} sequences; {self.batch_size} + {count} asked for"
            )
        self._add_lengths(count)
        self.seqs = self.seqs + free[:count]

    def set_lengths(self, lengths: list[int]) -> None:
        self._host_lengths = list(lengths)

    def __del__(self) -> None:
        if not sys.is_finalizing() and not getattr(self, "_view", False):
            self.model.release_context(self.context)
