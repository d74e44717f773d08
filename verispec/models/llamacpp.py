"""GGUF models on llama.cpp (llama-cpp-python's C API) behind verispec's model protocol.

Owns: `LlamaCppModel` (a GGUF file as a target or a draft: `vocab_size`, `device`,
`new_cache`, `prefill`, `forward(input_ids [B, T], cache) -> float32 logits [B, T, V]`), its
cache `LlamaCppCache`, `GGUFTokenizer` (text <-> ids with the GGUF's own vocabulary) and
`unavailable()` (why llama.cpp cannot run here, or None). llama.cpp does the passes: its
kernels, quantized formats and threads. The engine gets logits for every position, as from
any other model, and does the sampling and the accept-reject rule itself. Knows nothing of
sampling or speculation.

Cache contract (the same as `KVCache`'s). A cache owns one llama.cpp context; row b is llama.cpp
sequence b. A forward of T tokens is one `llama_decode` of B*T tokens (sequence b at positions
lengths[b] .. lengths[b]+T-1, logits requested at every position) and advances every length
by T. `rollback(lengths)` removes each row's positions from its new length on
(`llama_memory_seq_rm`), so the next forward writes them afresh. A context freed by a cache
is kept by its model and reused by the next cache that fits (one `llama_memory_clear`), so a
`generate` call does not pay for a new context.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from .checkpoint import CheckpointError
from .llama import CacheLengths

_N_BATCH = 512  # tokens per llama_decode call at least (a longer prefill is split); llama.cpp's ubatch
_TOKENS_PER_ROW = 9  # a context takes B * 9 tokens per llama_decode (a verification of k = 8 for every row) when that is more
_UBATCH_POSITIONS = 6  # a ubatch's pass over the weights costs about this many positions of compute: the built-in
#                       target on the 2-core EPYC, one row 10.7 ms a pass, each position more ~1.5 ms (8 rows: 22 ms plain, 34 ms at k = 1; server traces)
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: rows of one cache
_CPU_FLAGS = {  # llama_print_system_info() names -> /proc/cpuinfo flags
    "AVX": "avx", "AVX2": "avx2", "F16C": "f16c", "FMA": "fma", "BMI2": "bmi2", "AVX_VNNI": "avx_vnni",
    "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16",
    "AMX_INT8": "amx_int8",
}
_KV_TYPES = {"f16": 1, "f32": 0}
_SGEMM_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "IQ4_NL"}  # matrices llamafile's sgemm takes from 2 columns on
_SPLIT_KV_FROM = 240  # flash attention splits the cells of one query of one sequence over the threads once a pass reads
#                      512 cells: llama.cpp pads the cells read to 256, so from position 256 on (a margin below it)  # GGML_TYPE_F16, GGML_TYPE_F32
_lib = None
_exact_kernels = True  # process-wide: set_exact_kernels, before llama.cpp's library is initialised
_log: list[str] = []  # llama.cpp's recent error lines (its log is silenced; errors are quoted in ours)


def _llama():
    """The llama_cpp module, its backend initialised and its log captured (once)."""
    global _lib, _log_callback
    if _lib is None:
        import llama_cpp

        @llama_cpp.llama_log_callback
        def _log_callback(level: int, text: bytes, user_data) -> None:
            if level in (2, 4) and text:  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
                _log.append(text.decode(errors="replace").strip())
                del _log[:-4]

        # llama.cpp may log from a free() run while Python shuts down, after this module's globals
        # are gone: the callback must outlive them, so it is never released.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_log_callback))
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        if _exact_kernels:  # read once by ggml, at its first matrix product
            os.environ["GGML_CPU_TILED_MM"] = "0"
        llama_cpp.llama_backend_init()
        if "AMX" in llama_cpp.llama_print_system_info().decode(errors="replace"):
            _without_extra_buffers(llama_cpp)
        _lib = llama_cpp
    return _lib


def set_exact_kernels(on: bool) -> None:
    """Choose llama.cpp's settings for the whole process, before its first model loads.

    On (the default): a position's logits do not depend on the pass that computes them (how
    many positions or rows it holds, placeholders, the cache's size), so that speculative
    decoding gives plain decoding's tokens on every GGUF type. It takes four settings, each
    found by measuring (`deviation.pass_shape_deviation`; docs/EXACTNESS.md):
    - weights not repacked (`use_extra_bufts` off): repacked types run a GEMV kernel for one
      position and a GEMM kernel for more;
    - ggml's tiled K-quant/IQ product off (`GGML_CPU_TILED_MM=0`, read once by ggml): it takes
      passes of 8 positions or more, the dot-product kernel the rest;
    - flash attention on: each query position is its own dot products and online softmax over
      the unmasked cells, whatever the pass holds (without it the attention products of one
      position per sequence take another kernel than those of several);
    - a placeholder after a one-token pass (`LlamaCppModel.shape_invariant`): llamafile's sgemm
      (f32, f16, bf16, IQ4_NL, ...) takes passes of 2 positions or more, and flash attention splits
      one query's cells over the threads from 512 cells on (`_Context._single_pad`).
    Off: llama.cpp's defaults for the kernels (repacking, the tiled product) and attention without
    flash attention, as before; faster on some types, exact only where the measured deviation is 0.
    """
    global _exact_kernels
    if _lib is not None and bool(on) != _exact_kernels:
        raise RuntimeError("set_exact_kernels must be called before the first llama.cpp model loads")
    _exact_kernels = bool(on)


def exact_kernels() -> bool:
    return _exact_kernels


def _without_extra_buffers(llama_cpp) -> None:
    """Models load without llama.cpp's extra CPU buffer types (AMX, repacked weights), for every
    caller of llama_model_default_params (llama-cpp-python's `Llama` included). Measured
    2026-12-02 on a 2-core Xeon VM whose CPU flags list amx_int8/amx_tile (and whose kernel
    grants the tile state): a build with AMX_INT8 dies of SIGILL on the first decode of a q8_0
    or q4_0 file through the AMX buffer type, and runs with it off."""
    default = llama_cpp.llama_cpp.llama_model_default_params

    def model_params():
        params = default()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = llama_cpp.llama_model_default_params = model_params


def _cpu_flags() -> set[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def unavailable() -> str | None:
    """Why llama.cpp cannot run on this machine (one line), or None when it can.

    A llama.cpp library compiled for instructions this CPU lacks (a wheel built on another
    machine, say) would die of an illegal instruction at its first pass: refused here instead.
    """
    try:
        lib = _llama()
    except ImportError:
        return "llama-cpp-python is not installed (pip install 'verispec[llamacpp]')"
    except OSError as error:
        return f"llama.cpp's library does not load: {error}"
    flags = _cpu_flags()
    if flags is not None:
        info = lib.llama_print_system_info().decode(errors="replace")
        built = [name for name, flag in _CPU_FLAGS.items() if f" {name} = 1 " in f" {info} ".replace("|", " ")]
        missing = [name for name in built if _CPU_FLAGS[name] not in flags]
        if missing:
            return (f"this llama.cpp was built for {', '.join(missing)}, which this CPU lacks "
                    "(rebuild it here: pip install --force-reinstall --no-cache-dir llama-cpp-python)")
    return None


def system_info() -> str:
    """llama.cpp's own line on what it was built with (instruction sets, OpenMP, ...)."""
    return _llama().llama_print_system_info().decode(errors="replace").strip()


def default_threads() -> int:
    """The cores this process may run on: llama.cpp's threads, never more (no oversubscription)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class GGUFConfig:
    """What the engine and the tools read from a model's config, for a GGUF file."""

    num_parameters: int
    size_bytes: int  # the weights llama.cpp reads per pass
    max_position_embeddings: int  # the training context
    eos_token_id: int | None
    bos_token_id: int | None
    description: str  # llama.cpp's one-line description: architecture, size, type


class _Weights:
    """A loaded llama_model. Every context made from it holds a reference, so it is freed only
    after the model object and all its contexts are gone (whatever order Python finalizes them in)."""

    def __init__(self, handle):
        self.handle = handle

    def __del__(self) -> None:
        if not sys.is_finalizing():  # at exit llama.cpp's library may be unloaded already: the OS frees all
            _llama().llama_model_free(self.handle)


def _by_sequence(seqs: np.ndarray) -> np.ndarray | None:
    """The stable order that sorts a batch's tokens by sequence id, or None when they are sorted.

    With one KV stream per sequence (llama.cpp's default, `kv_unified` off) llama.cpp cuts a
    batch into ubatches of sequences whose ids rise by one in batch order, and each ubatch reads
    every weight: sequences [3, 1, 2, 0] run as three passes over the weights, [0, 1, 2, 3] as
    one. Rows join on the lowest free sequences (`LlamaCppCache.join`), so sorted, a server's
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


class _Context:
    """One llama.cpp context: its KV memory for n_seq sequences of up to n_ctx_seq positions, and
    a llama_batch of n_batch = max(_N_BATCH, 9 n_seq) tokens with numpy views on its arrays
    (filled without a copy). llama.cpp runs a batch in ubatches of _N_BATCH."""

    def __init__(self, model: "LlamaCppModel", n_seq: int, n_ctx_seq: int):
        lib = _llama()
        params = lib.llama_context_default_params()
        params.n_seq_max = n_seq
        params.n_ctx = n_seq * n_ctx_seq
        capacity = max(_N_BATCH, _TOKENS_PER_ROW * n_seq)
        params.n_batch, params.n_ubatch = capacity, _N_BATCH
        params.n_threads = params.n_threads_batch = model.n_threads
        params.no_perf = True
        params.type_k = params.type_v = _KV_TYPES[model.kv_type]
        # flash attention: on for shape-invariant passes (one query at a time over the unmasked cells);
        # else off, as llama-cpp-python's Llama (attention in the cache's type)
        params.flash_attn_type = 1 if model.shape_invariant else 0
        self.weights = model.weights  # freed after this context
        self.ptr = lib.llama_init_from_model(model.weights.handle, params)
        if not self.ptr:
            raise RuntimeError(f"{model.path}: llama.cpp could not create a context for {n_seq} x {n_ctx_seq} positions: {' / '.join(_log[-2:])}")
        self.n_seq, self.n_ctx_seq = n_seq, lib.llama_n_ctx_seq(self.ptr)
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
        self.invariant = model.shape_invariant  # no pass of one token; gaps always filled
        self.pad_always = True  # a placeholder after every one-token pass, unless the file needs none (LlamaCppModel._one_token_agrees)
        self._logits_view, self._logits_address = np.empty((0, self.vocab_size), np.float32), None

    def decode(self, tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray, outputs: np.ndarray | bool,
               read: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[np.ndarray | None, float]:
        """Run tokens [N] at positions [N] of sequences [N], with logits where outputs [N] (or one
        bool for all): (read(logits [n, V]) of each llama_decode, concatenated, or None without
        read; seconds spent inside llama_decode). read sees llama.cpp's own buffer in place (a
        view, reused by the next decode): it returns a copy or a reduction of it."""
        lib, results, inside = _llama(), [], 0.0
        pad = self._single_pad(tokens, positions, seqs, outputs)
        if pad is not None:  # one sequence, one token or one output: a second, with logits, after it
            outputs = np.concatenate([np.full(len(tokens), outputs) if isinstance(outputs, bool) else outputs, [True]])
            tokens, positions, seqs = np.append(tokens, tokens[-1]), np.append(positions, pad), np.append(seqs, seqs[-1])
        filled = self._fill_gaps(seqs, positions, always=self.invariant)
        if filled is not None:  # placeholders: every sequence in the range with as many tokens, one ubatch
            pads, pad_positions = filled
            outputs = np.concatenate([np.full(len(tokens), outputs) if isinstance(outputs, bool) else outputs, np.zeros(len(pads), bool)])
            tokens = np.concatenate([tokens, np.zeros(len(pads), tokens.dtype)])
            positions, seqs = np.concatenate([positions, pad_positions]), np.concatenate([seqs, pads])
        order = _by_sequence(seqs)
        if order is not None:  # llama.cpp's ubatches take runs of consecutive sequence ids in batch order
            tokens, positions, seqs = tokens[order], positions[order], seqs[order]
            if not isinstance(outputs, bool):
                outputs = outputs[order]
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
            started = time.perf_counter()
            status = lib.llama_decode(self.ptr, self.batch)
            inside += time.perf_counter() - started
            if status != 0:
                raise RuntimeError(f"llama_decode failed (status {status}): {' / '.join(_log[-2:])}")
            if read is not None:
                rows = count if isinstance(outputs, bool) else int(np.count_nonzero(outputs[start:end]))
                results.append(read(self.logits(rows)))
        if filled is not None:  # the placeholders' cells go: each sequence is as it was, plus its tokens
            pads, pad_positions = filled
            first = np.flatnonzero(np.r_[True, pads[1:] != pads[:-1]])  # each padded sequence's first placeholder
            for seq, position in zip(pads[first], pad_positions[first]):
                lib.llama_memory_seq_rm(self.memory, int(seq), int(position), -1)
        if pad is not None:
            lib.llama_memory_seq_rm(self.memory, int(seqs[-1]), int(pad), -1)
        if read is None:
            return None, inside
        found = np.concatenate(results) if len(results) > 1 else results[0]
        if pad is not None:
            found = found[:-1]  # the placeholder's row (one sequence: it is the last)
        if order is not None:  # back to the caller's order of output tokens
            found = found[np.argsort(order if isinstance(outputs, bool) else order[outputs])]
        return found, inside

    def _single_pad(self, tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray, outputs: np.ndarray | bool) -> int | None:
        """The position of a placeholder token that a shape-invariant pass adds, or None: a pass of
        one sequence with one token, or with logits at one position only, would run llama.cpp's
        one-column kernels (llamafile's sgemm takes 2 columns or more; the last layer and the
        output head run on the positions with logits) where those differ (`pad_always`, measured
        per model), and flash attention's split over threads from _SPLIT_KV_FROM on. The
        placeholder follows the sequence's last token, with logits, in the same llama_decode; its
        cell is removed after."""
        if not self.invariant or not 0 < len(tokens) < self.n_batch or not (seqs == seqs[0]).all():
            return None
        wanted = len(tokens) if outputs is True else 0 if outputs is False else int(np.count_nonzero(outputs))
        if len(tokens) > 1 and wanted != 1:
            return None
        position = int(positions.max()) + 1
        if not self.pad_always and position <= _SPLIT_KV_FROM:
            return None
        return position if position < self.n_ctx_seq else None

    def _fill_gaps(self, seqs: np.ndarray, positions: np.ndarray, always: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
        """(sequences, positions) of placeholder tokens that give every sequence from the batch's
        lowest to its highest the same number of tokens, or None where they would not pay.
        With one KV stream per sequence llama.cpp cuts a batch into ubatches of consecutive
        sequence ids that each take the same number of tokens from every one of them
        (split_equal), and each ubatch reads every weight: a row that finished left a gap in a
        server's sequences until a new row filled it (15 rows of the built-in target with one gap
        took 57-63 ms a pass against 46-48 without), and a gap filled with one token still cut a
        verification of 2 tokens a row in three (8 rows, k = 1: 50-59 ms against 33-35), as
        rows with 1 and 2 pending tokens cut a draft's pass in two. The placeholders go after
        each sequence's last cell (after its tokens in this batch), and their cells are removed
        after the decode (`decode`). Padded where that costs fewer positions than the ubatches it
        saves (`_UBATCH_POSITIONS` each): a decode pass, not a prefill of prompts of different lengths."""
        present, counts = np.unique(seqs, return_counts=True)
        lo, hi, most = int(present[0]), int(present[-1]), int(counts.max())
        if hi - lo + 1 == len(present) and int(counts.min()) == most:
            return None
        full = np.zeros(hi - lo + 1, dtype=np.int64)
        full[present - lo] = counts
        padded = len(full) * most
        pays = padded + _UBATCH_POSITIONS < int(full.sum()) + _UBATCH_POSITIONS * _ubatches(full, _N_BATCH)
        if padded > _N_BATCH or not (pays or always):  # a shape-invariant pass is one ubatch whatever it costs
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
            lib = _llama()
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

    def __init__(self, model: "LlamaCppModel", context: _Context, batch_size: int, max_length: int):
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
            if new < old:
                _llama().llama_memory_seq_rm(self.context.memory, seq, new, -1)
        self._host_lengths = list(lengths)

    def keep_rows(self, rows: list[int]) -> None:
        """Rows leave: their sequences are emptied and free; the others keep theirs (no copy)."""
        kept = [self.seqs[r] for r in rows]
        self._keep_lengths(rows)
        for seq in set(self.seqs) - set(kept):
            _llama().llama_memory_seq_rm(self.context.memory, seq, 0, -1)
        self.seqs = kept

    def reserve_row(self) -> "LlamaCppCache":
        """A one-row cache on a free sequence, for a prompt prefilled piece by piece before its
        request joins (`adopt_row`: the batch's last row, nothing copied; `release_row`)."""
        self._reserved = getattr(self, "_reserved", set())
        free = sorted(set(range(self.context.n_seq)) - set(self.seqs) - self._reserved)
        if not free:
            raise ValueError(f"the llama.cpp context holds {self.context.n_seq} sequences; none is free to reserve")
        seq = free[0]  # the lowest, as for a join: the batch's sequence ids stay consecutive (_by_sequence)
        _llama().llama_memory_seq_rm(self.context.memory, seq, 0, -1)
        view = LlamaCppCache.__new__(LlamaCppCache)
        view.max_length, view._host_lengths, view.model, view.context, view.seqs = self.max_length, [0], self.model, self.context, [seq]
        view._view = True  # shares the context: never hands it back
        self._reserved.add(seq)
        return view

    def adopt_row(self, view: "LlamaCppCache") -> None:
        self._reserved.discard(view.seqs[0])
        self.seqs = self.seqs + view.seqs
        self._host_lengths = self._host_lengths + view.host_lengths

    def release_row(self, view: "LlamaCppCache") -> None:
        self._reserved.discard(view.seqs[0])
        _llama().llama_memory_seq_rm(self.context.memory, view.seqs[0], 0, -1)

    def add_rows(self, count: int) -> None:
        """Rows join on free sequences of the context (empty: emptied when their rows left)."""
        free = sorted(set(range(self.context.n_seq)) - set(self.seqs) - getattr(self, "_reserved", set()))
        if count > len(free):
            raise ValueError(f"the llama.cpp context holds {self.context.n_seq} sequences; {self.batch_size} + {count} asked for")
        self._add_lengths(count)
        self.seqs = self.seqs + free[:count]

    def set_lengths(self, lengths: list[int]) -> None:
        self._host_lengths = list(lengths)

    def __del__(self) -> None:
        if not sys.is_finalizing() and not getattr(self, "_view", False):
            self.model._release(self.context)


class LlamaCppModel:
    """A GGUF file on llama.cpp with verispec's model interface (a target, or inside ModelDrafter).

    `forward(input_ids [B, T], cache)` writes positions cache.lengths .. +T-1 of every row and
    returns float32 logits [B, T, V]; without a cache it scores whole sequences from position 0.
    `n_threads` defaults to the cores this process may use (`default_threads`) and is capped
    there (more threads than cores only wait for each other). `kv_type` is
    the KV cache's type: "f16" (llama.cpp's default) or "f32" (logits equal to verispec's
    PyTorch model on the same f32 weights to about 1e-5, instead of 1e-3; attention then runs
    without flash attention, whose f32 cache llama.cpp casts to f16, so its passes are not
    shape-invariant: docs/EXACTNESS.md).
    """

    device = torch.device("cpu")
    dtype = torch.float32  # of the logits; the weights are whatever the GGUF holds

    def __init__(self, path: str | Path, n_threads: int | None = None, kv_type: str = "f16"):
        if kv_type not in _KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(_KV_TYPES)}, got {kv_type!r}")
        reason = unavailable()
        if reason is not None:
            raise CheckpointError(f"{path}: cannot run on llama.cpp: {reason}")
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: no such GGUF file")
        lib = _llama()
        params = lib.llama_model_default_params()
        if _exact_kernels:
            params.use_extra_bufts = False  # repacked weights: a GEMV kernel for one position, GEMM for more
        # a draft may turn it off before its first cache (its logits need not be invariant); an f32 KV cache runs
        # attention without flash attention (llama.cpp casts it to f16 for that), so its passes are not invariant
        self.shape_invariant = _exact_kernels and kv_type == "f16"
        _log.clear()
        handle = lib.llama_model_load_from_file(str(path).encode(), params)
        if not handle:
            raise CheckpointError(f"{path}: llama.cpp cannot load it: {' / '.join(_log[-2:]) or 'unknown error'}")
        self.weights = _Weights(handle)
        self.path = path
        self.n_threads = min(n_threads or default_threads(), default_threads())
        self.kv_type = kv_type
        self.vocab = lib.llama_model_get_vocab(handle)
        self.vocab_size = int(lib.llama_vocab_n_tokens(self.vocab))
        description = ctypes.create_string_buffer(256)
        lib.llama_model_desc(handle, description, len(description))
        eos, bos = lib.llama_vocab_eos(self.vocab), lib.llama_vocab_bos(self.vocab)
        self.config = GGUFConfig(
            num_parameters=int(lib.llama_model_n_params(handle)),
            size_bytes=int(lib.llama_model_size(handle)),
            max_position_embeddings=int(lib.llama_model_n_ctx_train(handle)),
            eos_token_id=eos if eos >= 0 else None,
            bos_token_id=bos if bos >= 0 else None,
            description=description.value.decode(errors="replace"),
        )
        self._spare: _Context | None = None
        self._agrees: bool | None = None  # no matrix of a type sgemm takes (_one_token_agrees), read once
        self.forward_compute_s = 0.0  # seconds inside llama_decode in forward(), ever: the rest of a step is verispec's

    def __repr__(self) -> str:
        return f"LlamaCppModel({str(self.path)!r}, {self.config.description}, {self.n_threads} threads)"

    def new_cache(self, batch_size: int, max_length: int) -> LlamaCppCache:
        """A cache of batch_size rows of max_length positions: the spare context if it fits."""
        if not 1 <= batch_size <= MAX_SEQUENCES:
            raise ValueError(f"llama.cpp runs 1 to {MAX_SEQUENCES} sequences at once, got a batch of {batch_size}")
        spare, self._spare = self._spare, None
        if spare is not None and spare.n_seq >= batch_size and spare.n_ctx_seq >= max_length:
            _llama().llama_memory_clear(spare.memory, True)
            return LlamaCppCache(self, spare, batch_size, max_length)
        if spare is not None:
            spare.free()
        context = _Context(self, batch_size, max_length)
        if context.invariant:
            context.pad_always = not self._one_token_agrees()
        return LlamaCppCache(self, context, batch_size, max_length)

    def _one_token_agrees(self) -> bool:
        """Whether a one-token pass takes the same matrix kernels as a pass of several: true when no
        matrix of the file has a type that llamafile's sgemm takes from 2 columns on (f32, f16,
        bf16, q8_0, q4_0, q5_0, iq4_nl on x86; read from the file). The K-quants, q4_1, q5_1 and the
        IQ types then always take their dot-product kernels (with ggml's tiled product off), so a
        plain pass needs no placeholder until flash attention would split a query's cells
        (_SPLIT_KV_FROM): on files that sit in the caches a placeholder costs 1.5-2x a one-token
        pass (BENCHMARKS.md). Measuring instead (a one-token pass against a two-token one) was
        tried and was not enough: sgemm's results also change between 2 and 3 columns."""
        if self._agrees is None:
            try:
                from gguf import GGUFReader

                types = {t.tensor_type.name for t in GGUFReader(str(self.path)).tensors if len(t.shape) > 1 and t.shape[1] > 1}
            except Exception:  # no gguf package, or a file it cannot read: the placeholder, always
                types = {"F32"}
            self._agrees = not types & _SGEMM_TYPES
        return self._agrees

    def _release(self, context: _Context) -> None:
        """A cache is gone: keep its context for the next one (the larger of two), free the other."""
        if self._spare is None:
            self._spare = context
            return
        keep, drop = sorted((self._spare, context), key=lambda c: c.n_seq * c.n_ctx_seq, reverse=True)
        self._spare = keep
        drop.free()

    def __call__(self, input_ids: torch.Tensor, cache: LlamaCppCache | None = None) -> torch.Tensor:
        return self.forward(input_ids, cache)

    def forward(self, input_ids: torch.Tensor, cache: LlamaCppCache | None = None) -> torch.Tensor:
        """input_ids [B, T] -> float32 logits [B, T, V]."""
        batch, length = input_ids.shape
        logits = self._decode_rows(input_ids, cache, _copy)
        return torch.from_numpy(logits).view(batch, length, self.vocab_size)

    def forward_argmax(self, input_ids: torch.Tensor, cache: LlamaCppCache | None = None) -> torch.Tensor:
        """input_ids [B, T] -> the argmax token at every position [B, T] long: `forward(...)
        .argmax(-1)` (the same ids; ties go to the lowest id in both), read from llama.cpp's
        buffer in place, without a logits tensor."""
        batch, length = input_ids.shape
        return torch.from_numpy(self._decode_rows(input_ids, cache, _argmax)).view(batch, length)

    def _decode_rows(self, input_ids: torch.Tensor, cache: LlamaCppCache | None, read) -> np.ndarray:
        batch, length = input_ids.shape
        if cache is None:  # whole sequences from position 0, in a cache of their own
            cache = self.new_cache(batch, length)
        lengths = cache.host_lengths
        span = max(lengths) + length
        if span > cache.max_length:
            raise ValueError(f"KV cache overflow: {span} positions needed, cache holds {cache.max_length}")
        if batch == 1:
            positions, seqs = np.arange(lengths[0], span), np.full(length, cache.seqs[0], dtype=np.int64)
        else:
            positions = (np.asarray(lengths)[:, None] + np.arange(length)).ravel()  # [B*T]
            seqs = np.repeat(np.asarray(cache.seqs), length)  # [B*T]
        result, inside = cache.context.decode(input_ids.numpy().ravel(), positions, seqs, read is not None, read)
        self.forward_compute_s += inside
        cache.advance(length)
        return result

    def write(self, input_ids: torch.Tensor, cache: LlamaCppCache) -> None:
        """Write input_ids [B, T] at each row's length without asking for logits (a prompt read
        piece by piece)."""
        self._decode_rows(input_ids, cache, None)

    def greedy_continuation(self, input_ids: torch.Tensor, counts: list[int], steps: int, cache: LlamaCppCache,
                            confidence_threshold: float = 0.0, live: np.ndarray | None = None) -> torch.Tensor:
        """The model's own greedy continuation: read row b's first counts[b] tokens of
        input_ids [B, W], then `steps` times take the argmax token and (but the last) read it.
        Returns those tokens [B, steps] long; row b's cache grows by counts[b] + steps - 1.
        The same tokens as that loop over `forward` and `argmax`, at one llama_decode per step
        with logits only at each row's last token, read in place: a draft model's proposals
        at temperature 0 with no tensor work between its passes. With a confidence_threshold,
        it stops after the first step where every row's token (every row where `live` [B] bool
        is true, when given) has a softmax probability below it (fewer columns; the cache
        grows by the steps taken, minus one)."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        batch, lengths = len(counts), cache.host_lengths
        ends = np.asarray(lengths) + np.asarray(counts)  # [B] each row's next position
        if int(ends.max()) + steps - 1 > cache.max_length:
            raise ValueError(f"KV cache overflow: {int(ends.max()) + steps - 1} positions needed, cache holds {cache.max_length}")
        ids = input_ids.numpy()
        tokens = ids[0, : counts[0]] if batch == 1 else np.concatenate([ids[b, :count] for b, count in enumerate(counts)])
        positions = np.concatenate([np.arange(n, end) for n, end in zip(lengths, ends)])
        seqs = np.repeat(np.asarray(cache.seqs), counts)
        outputs = np.zeros(len(tokens), dtype=bool)
        outputs[np.cumsum(counts) - 1] = True  # logits at each row's last token only
        drafted = np.empty((batch, steps), dtype=np.int64)
        context, rows = cache.context, np.asarray(cache.seqs)
        read = _argmax_confidence if confidence_threshold > 0 else _argmax
        found, inside = context.decode(tokens, positions, seqs, outputs, read)
        for i in range(steps):
            if i > 0:
                found, seconds = context.decode(drafted[:, i - 1], ends + i - 1, rows, True, read)
                inside += seconds
            if confidence_threshold > 0:
                drafted[:, i], confidence = found[:, 0], found[:, 1]
                if ((confidence if live is None else confidence[live]) < confidence_threshold).all():
                    steps = i + 1
                    break
            else:
                drafted[:, i] = found
        self.forward_compute_s += inside
        cache.set_lengths((ends + steps - 1).tolist())
        return torch.from_numpy(drafted[:, :steps])

    def compiled_step(self, cache: LlamaCppCache, drafter, sampling, prompts: list[list[int]], k_max: int):
        """The engine's whole iteration with a llama.cpp draft (or none: plain decoding) as one
        compiled call (`llamacpp_step.CompiledStep`), or None where it does not apply or cannot
        be built."""
        from .llamacpp_step import CompiledStep

        return CompiledStep.maybe(self, cache, drafter, sampling, prompts, k_max)

    def prefill(self, prompts: list[list[int]], cache: LlamaCppCache) -> None:
        """Write ragged prompts [B][len_b] into an empty cache (no padding: llama.cpp batches are ragged)."""
        if max(cache.host_lengths) != 0:
            raise ValueError("prefill needs an empty cache")
        lengths = [len(p) for p in prompts]
        if sum(lengths):
            if max(lengths) > cache.max_length:
                raise ValueError(f"KV cache overflow: {max(lengths)} positions needed, cache holds {cache.max_length}")
            tokens = np.fromiter((t for p in prompts for t in p), dtype=np.int32, count=sum(lengths))
            positions = np.concatenate([np.arange(n) for n in lengths])
            seqs = np.repeat(np.asarray(cache.seqs), lengths)
            cache.context.decode(tokens, positions, seqs, False)
        cache.set_lengths(lengths)


    def prefill_rows(self, prompts: list[list[int]], cache: LlamaCppCache, rows: list[int]) -> None:
        """Rows rows[i] (their sequences) hold prompts[i] afterwards; the other rows are
        untouched (models/rows.py): each row's sequence is emptied, then written."""
        lengths = [len(p) for p in prompts]
        if max(lengths, default=0) > cache.max_length:
            raise ValueError(f"KV cache overflow: {max(lengths)} positions needed, cache holds {cache.max_length}")
        seqs = [cache.seqs[row] for row in rows]
        for seq in seqs:
            _llama().llama_memory_seq_rm(cache.context.memory, seq, 0, -1)
        if sum(lengths):
            tokens = np.fromiter((t for p in prompts for t in p), dtype=np.int32, count=sum(lengths))
            positions = np.concatenate([np.arange(n) for n in lengths])
            cache.context.decode(tokens, positions, np.repeat(np.asarray(seqs), lengths), False)
        host = cache.host_lengths
        for row, n in zip(rows, lengths):
            host[row] = n
        cache.set_lengths(host)

def _copy(logits: np.ndarray) -> np.ndarray:
    return logits.copy()


def _argmax(logits: np.ndarray) -> np.ndarray:
    return logits.argmax(axis=-1)


def _argmax_confidence(logits: np.ndarray) -> np.ndarray:
    """[n, 2]: the argmax of each row and its softmax probability, 1 / sum(exp(logits - max))."""
    top = logits.max(axis=-1, keepdims=True)
    return np.stack([logits.argmax(axis=-1), 1.0 / np.exp(logits - top).sum(axis=-1)], axis=-1)


class Encoding(NamedTuple):
    ids: list[int]


class GGUFTokenizer:
    """Text <-> token ids with a GGUF's own vocabulary (llama.cpp's tokenizer), shaped like the
    `tokenizers` calls verispec makes: `encode(text).ids` and `decode(ids, skip_special_tokens)`.
    Nothing is added (no BOS): the ids are the text's own, as with a Hugging Face tokenizer.json."""

    def __init__(self, model: LlamaCppModel):
        self.model = model  # keeps the vocabulary alive

    def encode(self, text: str) -> Encoding:
        lib, data = _llama(), text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            buffer = (lib.llama_token * capacity)()
            count = lib.llama_tokenize(self.model.vocab, data, len(data), buffer, capacity, False, True)
            if count >= 0:
                return Encoding(list(buffer[:count]))
            capacity = -count

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        lib = _llama()
        tokens = (lib.llama_token * max(len(ids), 1))(*ids)
        capacity = 8 * len(ids) + 16
        while True:
            buffer = ctypes.create_string_buffer(capacity)
            count = lib.llama_detokenize(self.model.vocab, tokens, len(ids), buffer, capacity, False, not skip_special_tokens)
            if count >= 0:
                return buffer.raw[:count].decode("utf-8", errors="replace")
            capacity = -count
