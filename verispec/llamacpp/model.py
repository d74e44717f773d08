"""A GGUF file on llama.cpp (llama-cpp-python's C API) behind verispec's model protocol.

Owns `LlamaCppModel` (a GGUF file as a target or a draft: `vocab_size`, `device`, `new_cache`,
`prefill`, `forward(input_ids [B, T], cache) -> float32 logits [B, T, V]`, `forward_argmax`,
`greedy_continuation`, and `compiled_step`, the offer of step.CompiledStep to the engine) and
`GGUFConfig`. llama.cpp does the passes: its kernels, quantized formats and threads. The engine
gets logits for every position, as from any other model, and does the sampling and the
accept-reject rule itself. A context freed by a cache is kept by its model and reused by the
next cache that fits (one `llama_memory_clear`), so a `generate` call does not pay for a new
context. Caches and batches are context.py's; loading the library is lib.py's. Knows nothing of
sampling or speculation.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..models.checkpoint import CheckpointError
from ..models.gguf_header import check as check_gguf
from . import regime
from .context import KV_TYPES, MAX_SEQUENCES, SPLIT_KV_FROM, Context, LlamaCppCache
from .head import HEAD_NAMES, matrix_types, own_head, width_dependent
from .lib import clear_log, default_threads, exact_kernels, library, log_tail, unavailable
from .step import CompiledStep


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
            library().llama_model_free(self.handle)


class LlamaCppModel:
    """A GGUF file on llama.cpp with verispec's model interface (a target, or inside ModelDrafter).

    `forward(input_ids [B, T], cache)` writes positions cache.lengths .. +T-1 of every row and
    returns float32 logits [B, T, V]; without a cache it scores whole sequences from position 0.
    `n_threads` defaults to the cores this process may use (`default_threads`) and is capped
    there (more threads than cores only wait for each other). `kv_type` is
    the KV cache's type: "f16" (llama.cpp's default) or "f32" (logits equal to verispec's
    PyTorch model on the same f32 weights to about 1e-5, instead of 1e-3). Both are
    shape-invariant under exact kernels (docs/EXACTNESS.md). `flash_attention`: whether its
    shape-invariant contexts run flash attention or sgemm's attention (context.py; chosen by
    regime.py).
    """

    device = torch.device("cpu")
    dtype = torch.float32  # of the logits; the weights are whatever the GGUF holds

    def __init__(self, path: str | Path, n_threads: int | None = None, kv_type: str = "f16"):
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(KV_TYPES)}, got {kv_type!r}")
        reason = unavailable()
        if reason is not None:
            raise CheckpointError(f"{path}: cannot run on llama.cpp: {reason}")
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: no such GGUF file")
        try:
            check_gguf(path)  # llama.cpp would say only "error loading model"
        except ValueError as error:
            raise CheckpointError(str(error)) from None
        lib = library()
        params = lib.llama_model_default_params()
        if exact_kernels():
            params.use_extra_bufts = False  # repacked weights: a GEMV kernel for one position, GEMM for more
        # a draft may turn it off before its first cache (its logits need not be invariant)
        self.shape_invariant = exact_kernels()
        clear_log()
        handle = lib.llama_model_load_from_file(str(path).encode(), params)
        if not handle:
            raise CheckpointError(f"{path}: llama.cpp cannot load it: {log_tail() or 'unknown error'}")
        self.weights = _Weights(handle)
        self.path = path
        # a recurrent or hybrid model (Mamba, RWKV, Jamba, ...) keeps a state per sequence, not a cell per position:
        # it cannot forget rejected positions, so it decodes plainly (assemble.load_drafter) in one pass shape
        recurrent, hybrid = lib.llama_model_is_recurrent(handle), lib.llama_model_is_hybrid(handle)
        self.memory_kind = "recurrent" if recurrent else "hybrid" if hybrid else ""
        self.rolls_back = not self.memory_kind
        self.shape_invariant = self.shape_invariant and self.rolls_back
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
            description=_described(description.value.decode(errors="replace"), int(lib.llama_model_n_params(handle))),
        )
        self._spare: Context | None = None
        self.forward_compute_s = 0.0  # seconds inside llama_decode in forward(), ever: the rest of a step is verispec's

    @functools.cached_property
    def flash_attention(self) -> bool:
        """Whether shape-invariant contexts run flash attention (context.py's placeholder rules); chosen once
        (regime.py: by file type, or measured), when a shape-invariant context first asks (a draft's
        never does; without shape invariance nothing is chosen)."""
        return self.shape_invariant and regime.flash_for(self)

    @functools.cached_property
    def own_head(self) -> bool:
        """Whether shape-invariant contexts compute the output head with one kernel at every width
        (head.py: a file whose only matrix of a type llamafile's sgemm takes is its head)."""
        return self.shape_invariant and own_head(self)

    @functools.cached_property
    def sgemm_weights(self) -> bool:
        """Whether a matrix that llama.cpp computes takes llamafile's sgemm from 2 columns on with results
        that differ from its one-column kernel's on this CPU (read from the file's header; head.width_dependent;
        the head is not llama.cpp's where `own_head`)."""
        return bool(width_dependent(matrix_types(self.path, exclude=HEAD_NAMES if self.own_head else ())))

    @property
    def pads_lone_passes(self) -> bool:
        """Whether every pass of one position carries a second, a placeholder (with logits when its row is
        alone): under sgemm's attention, or flash attention over sgemm's weights (context.py; llama_step.c's
        `lone`). A guess there is verified at no cost (drafters/placeholder.py)."""
        return self.shape_invariant and (not self.flash_attention or self.sgemm_weights)

    @property
    def lone_pad_from(self) -> int | None:
        """The least length of a lone row's text (its committed tokens, the one the pass reads included) from
        which its one-position passes carry a placeholder: 0 where every one does (`pads_lone_passes`),
        SPLIT_KV_FROM + 1 under flash attention over dot-product weights (flash attention would split the
        query's cells from there on: context.py, llama_step.c), None where none does. A guess in the row's
        own sequence there costs the placeholder's attention to the row's cells (drafters/placeholder.py)."""
        if not self.shape_invariant:
            return None
        return 0 if self.pads_lone_passes else SPLIT_KV_FROM + 1

    @property
    def query_cost_per_cell(self) -> float:
        """One query's attention to one cell over one position's matrix products, in multiply-adds (2 n_layer
        n_embd over the parameters): what a position attending to n cells adds to a pass, at most n times
        this of a pass (a position costs at most a pass)."""
        lib, handle = library(), self.weights.handle
        return 2.0 * lib.llama_model_n_layer(handle) * lib.llama_model_n_embd(handle) / self.config.num_parameters

    def __repr__(self) -> str:
        return f"LlamaCppModel({str(self.path)!r}, {self.config.description}, {self.n_threads} threads)"

    def new_cache(self, batch_size: int, max_length: int) -> LlamaCppCache:
        """A cache of batch_size rows of max_length positions: the spare context if it fits."""
        if not 1 <= batch_size <= MAX_SEQUENCES:
            raise ValueError(f"llama.cpp runs 1 to {MAX_SEQUENCES} sequences at once, got a batch of {batch_size}")
        spare, self._spare = self._spare, None
        if spare is not None and spare.n_seq >= batch_size and spare.n_ctx_seq >= max_length:
            library().llama_memory_clear(spare.memory, True)
            return LlamaCppCache(self, spare, batch_size, max_length)
        if spare is not None:
            spare.free()
        return LlamaCppCache(self, Context(self, batch_size, max_length), batch_size, max_length)

    def release_context(self, context: Context) -> None:
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

    def greedy_continuation(
        self,
        input_ids: torch.Tensor,
        counts: list[int],
        steps: int,
        cache: LlamaCppCache,
        confidence_threshold: float = 0.0,
        live: np.ndarray | None = None,
    ) -> torch.Tensor:
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
            raise ValueError(
                f"KV cache overflow: {int(ends.max()) + steps - 1} positions needed, cache holds {cache.max_length}"
            )
        ids = input_ids.numpy()
        tokens = (
            ids[0, : counts[0]] if batch == 1 else np.concatenate([ids[b, :count] for b, count in enumerate(counts)])
        )
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

    def compiled_step(
        self, cache: LlamaCppCache, drafter, sampling, prompts: list[list[int]], k_max: int
    ) -> CompiledStep | None:
        """The engine's whole iteration with a llama.cpp draft (or none: plain decoding) as one
        compiled call (`step.CompiledStep`), or None where it does not apply or cannot be built."""
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
            library().llama_memory_seq_rm(cache.context.memory, seq, 0, -1)
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


def _described(description: str, parameters: int) -> str:
    """llama.cpp's "ARCH SIZE TYPE" with SIZE counted from the file's tensors: llama.cpp's size label
    is its guess of the model family's size from the layer count ("256M" for a 135M SmolLM2, "?B")."""
    arch, _, rest = description.partition(" ")
    _, _, type_name = rest.partition(" ")
    count = f"{parameters / 1e6:.0f}M" if parameters < 1e9 else f"{parameters / 1e9:.1f}B"
    return " ".join(part for part in (arch, count, type_name) if part)
