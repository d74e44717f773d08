"""The speculative iteration on a llama.cpp target and a llama.cpp draft, in one compiled call.

Owns `CompiledStep` (the state of one `generate` call: both models' pending tokens and
lengths as arrays the compiled step reads and writes), `step_status()` (whether the compiled
step is in use here, or why not) and `compiled_rule` (the C rule alone, on given logits, for the
tests that compare it with `rejection.verify_batch`). llama_step.c, beside this file, does what
the engine's Python path (step.PythonStep) does with a `ModelDrafter`: propose, score, the
accept-reject rule, both rollbacks, in C against llama.cpp's C API: between two target passes
Python runs cold (the pass streams the weights through the caches), and the dozen Python and
torch steps of an iteration cost about 1 ms there. At temperature 0 it is `greedy_continuation`,
`forward_argmax` and `rejection.verify_greedy`; at T > 0 without top-k, top-p or min-p it is
`rejection.verify` on softmax(logits / T), with its own random stream. The Python path stays
the reference: tests compare the two token for token at T = 0, the rule alone on random inputs
at T > 0, and the exactness suite runs the compiled step at T > 0.

The library is compiled on first use (a C compiler and llama-cpp-python's installed
`llama.h`; under a second) into a directory keyed by the source's hash, llama.cpp's version,
the flags and this CPU's, beside the kernels. Where that fails, or `VERISPEC_LLAMA_STEP=0`,
the engine uses its Python path and `step_status()` says why. Knows nothing of drafters but the
`DraftSource` protocol below, nor of text.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ..models.kernels import cache_root
from .context import LlamaCppCache
from .lib import cpu_flags, library, log_tail

_SOURCE = Path(__file__).resolve().parent / "llama_step.c"
# compile only: linking with -ffast-math would set flush-to-zero process-wide
_CFLAGS = ["-O3", "-march=native", "-ffast-math"]
_TOO_MANY_TOKENS = -1
_library = None
_status = "not loaded"

_p = ctypes.c_void_p


class _StepArgs(ctypes.Structure):
    """`struct verispec_step_args` of llama_step.c, field by field in the same order."""

    _fields_ = [
        ("draft", _p),  # the draft's llama_context, or NULL: plain decoding (k = 0 only)
        ("draft_batch", _p),  # the draft's llama_batch of `capacity` tokens (NULL without a draft)
        ("target", _p),  # the target's llama_context
        ("target_batch", _p),  # the target's llama_batch of `capacity` tokens
        ("capacity", ctypes.c_int32),  # tokens one batch holds
        ("rows", ctypes.c_int32),  # rows of the batch; row b is llama.cpp sequence b in both contexts
        ("active", _p),  # uint8 [rows]: 0 where the row finished (it takes no part)
        ("k", ctypes.c_int32),  # proposals wanted this step (0: a plain step); set before each call
        ("p_min", ctypes.c_float),  # the draft's confidence threshold (0: off)
        ("temperature", ctypes.c_float),  # 0: greedy; > 0: softmax(logits / T), no other filter
        ("rng", _p),  # uint64 [rows]: each row's splitmix64 state
        ("draft_probs", _p),  # float32 [rows, k, V]: q of every proposal (T > 0)
        ("scratch", _p),  # float32 [2 V]: p and the residual of one position (T > 0)
        ("beta", _p),  # float64 [rows, k] out: sum min(p, q) at each verified position
        ("draft_pending", _p),  # int32 [rows, width] in/out: committed tokens the draft has not read
        ("width", ctypes.c_int32),  # columns of draft_pending
        ("draft_count", _p),  # int32 [rows] in/out: how many of them
        ("draft_length", _p),  # int32 [rows] in/out: the draft cache's lengths
        ("target_pending", _p),  # int32 [rows] in/out: the token the target reads next
        ("target_length", _p),  # int32 [rows] in/out: the target cache's lengths
        ("proposals", _p),  # int32 [rows, k] out: the draft's tokens
        ("output", _p),  # int32 [rows, k + 1] out: the committed tokens
        ("num_accepted", _p),  # int32 [rows] out
        ("seconds", _p),  # float64 [2]: grow by the seconds inside the draft's and the target's llama_decode
        ("invariant", ctypes.c_int32),  # 0: ordinary passes; 1: placeholders; 2: and after every one-token pass
    ]


class DraftModel(Protocol):
    """A drafter's own draft model between steps, as `DraftSource.own_model` gives it (drafters.base.OwnModel)."""

    model: Any  # the draft model: the compiled step runs it when its cache is a LlamaCppCache
    cache: Any  # its cache, row b the batch's row b
    pending: torch.Tensor  # [B, P] long: row b's first pending_count[b] tokens are committed, unread by the draft
    pending_count: list[int]
    confidence_threshold: float  # stop drafting once every row's top q is below it (0: off)


class DraftSource(Protocol):
    """What the compiled step asks of a drafter (drafters.model.ModelDrafter keeps it): its own
    model, or None where its proposals are not a model's own (the step then does not apply).
    Read once, at the start; from then on the step owns that state."""

    def own_model(self) -> DraftModel | None: ...


def _headers() -> Path | None:
    import llama_cpp

    package = Path(llama_cpp.__file__).resolve().parent
    for folder in (package.parent / "include", package / "include"):  # where the wheel puts llama.h
        if (folder / "llama.h").is_file():
            return folder
    return None


def _build() -> Path:
    """The compiled library's path, compiled first where the cache does not hold it."""
    import llama_cpp

    include, compiler = _headers(), shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    lib_dir = Path(llama_cpp.__file__).resolve().parent / "lib"
    if include is None or compiler is None:
        raise RuntimeError("no llama.h beside llama-cpp-python" if include is None else "no C compiler (cc)")
    flags = " ".join(sorted(cpu_flags() or ())).encode()  # built for this CPU (-march=native)
    key = hashlib.sha256(
        b"\0".join(
            [
                _SOURCE.read_bytes(),
                (include / "llama.h").read_bytes(),
                llama_cpp.__version__.encode(),
                " ".join(_CFLAGS).encode(),
                flags,
            ]
        )
    ).hexdigest()[:16]
    target = cache_root() / f"llama_step-{key}" / "llama_step.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    for command in (
        [compiler, *_CFLAGS, "-fPIC", "-c", f"-I{include}", str(_SOURCE), "-o", f"{partial}.o"],  # fast math here,
        [
            compiler,
            "-shared",
            f"{partial}.o",
            f"-L{lib_dir}",
            "-lllama",
            f"-Wl,-rpath,{lib_dir}",
            "-lm",
            "-o",
            str(partial),
        ],
    ):  # not here
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the compiler failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:200]}")
    Path(f"{partial}.o").unlink()
    os.replace(partial, target)  # atomic: another process never loads half a library
    return target


def _load():
    """The compiled library (ctypes, its two functions typed), built on first use; None where it cannot be."""
    global _library, _status
    if _status != "not loaded":
        return _library
    if os.environ.get("VERISPEC_LLAMA_STEP", "1") == "0":
        _status = "disabled by VERISPEC_LLAMA_STEP=0"
        return None
    try:
        target = _build()
        library()  # llama.cpp's library loaded first: ours links to the same one
        loaded = ctypes.CDLL(str(target))
        loaded.verispec_step.restype = ctypes.c_int32
        loaded.verispec_step.argtypes = [ctypes.POINTER(_StepArgs)]
        loaded.verispec_rule.restype = ctypes.c_int32
        loaded.verispec_rule.argtypes = [_p, _p, _p, ctypes.c_int32, ctypes.c_int32, ctypes.c_float, _p, _p, _p, _p, _p]
        _library, _status = loaded, f"compiled step loaded ({target.parent})"
    except Exception as error:  # no compiler, no header, ...: the engine's Python path; said once
        _status = f"compiled step unavailable ({type(error).__name__}: {str(error)[:200]})"
        print(f"verispec: {_status}; using the Python path", file=sys.stderr, flush=True)
    return _library


def step_status() -> str:
    _load()
    return _status


def compiled_rule(
    logits: np.ndarray,
    proposals: np.ndarray,
    draft_probs: np.ndarray | None,
    temperature: float,
    rng: int = 0,
    uniforms: np.ndarray | None = None,
) -> tuple[list[int], int, list[float], int]:
    """llama_step.c's rule on one row: logits [k+1, V] float32 (the target's raw logits), proposals
    [k], draft_probs [k, V] float32 (q; None at temperature 0). Its random numbers are `uniforms`
    [k+1] float64 by role (u_i for the test of position i, u_k for the recovered or bonus draw: the
    roles of `rejection.verify`), or else drawn in turn from a splitmix64 stream in state `rng` (as
    the compiled step draws them). Returns (output tokens [n+1], n accepted, beta at the verified
    positions, the stream's state after)."""
    loaded = _load()
    if loaded is None:
        raise RuntimeError(f"the compiled rule is not available: {_status}")
    logits = np.ascontiguousarray(logits, np.float32)
    k, vocab = logits.shape[0] - 1, logits.shape[1]
    rows = (ctypes.c_void_p * (k + 1))(*(logits.ctypes.data + i * logits.strides[0] for i in range(k + 1)))
    proposals = np.ascontiguousarray(proposals, np.int32)
    q = None if draft_probs is None else np.ascontiguousarray(draft_probs, np.float32)
    given = None if uniforms is None else np.ascontiguousarray(uniforms, np.float64)
    scratch, state = np.zeros(2 * vocab, np.float32), np.array([rng], np.uint64)
    output, beta = np.full(k + 1, -1, np.int32), np.full(max(k, 1), np.nan)
    n = loaded.verispec_rule(
        rows,
        proposals.ctypes.data,
        None if q is None else q.ctypes.data,
        k,
        vocab,
        temperature,
        scratch.ctypes.data,
        state.ctypes.data,
        None if given is None else given.ctypes.data,
        output.ctypes.data,
        beta.ctypes.data,
    )
    return output[: n + 1].tolist(), n, beta[: min(n + 1, k)].tolist(), int(state[0])


def _capacity(cache: LlamaCppCache, draft: DraftModel | None) -> int:
    """Tokens one llama_decode takes in both contexts (the C step fills both batches up to it)."""
    return min(cache.context.n_batch, draft.cache.context.n_batch) if draft is not None else cache.context.n_batch


class CompiledStep:
    """Both models' state for the compiled step, over the caches of one `generate` call.

    `maybe(target, cache, drafter, sampling, prompts, k_max)` returns one when it applies (a
    `LlamaCppModel` target; a drafter whose `own_model()` is a llama.cpp model of the same
    vocabulary, or no drafter: plain decoding; every row with the same settings: temperature 0, or
    rejection sampling at a temperature with no top-k, top-p or min-p; the compiled step loaded;
    B*(k+1) positions in one llama.cpp batch of both contexts). It keeps the engine's step
    interface (step.PythonStep's): `run(k, pending, logprobs)` runs one iteration for the active
    rows, `commit` has nothing left to do, and rows that finish are `retire`d: they take no part
    in later steps and their caches stop growing; rows never join (`can_change_rows` is false).
    At T > 0 row b draws from its own splitmix64 stream, started where `RowStreams` starts it (so
    a seed gives the same tokens each run, whatever the other rows; not the Python path's tokens,
    which draw in another order)."""

    can_change_rows = False

    def __init__(
        self,
        loaded,
        target,
        cache: LlamaCppCache,
        draft: DraftModel | None,
        prompts: list[list[int]],
        sampling,
        k_max: int,
    ):
        lib, batch = library(), len(prompts)
        self._function, self._lib = loaded.verispec_step, lib
        self.target, self.cache = target, cache
        self.draft, self.draft_cache = (draft.model, draft.cache) if draft is not None else (None, None)
        self.capacity = _capacity(cache, draft)
        self._batches = [lib.llama_batch_init(self.capacity, 0, 1) for _ in range(2)]
        params = sampling.shared
        # pending tokens: a whole prompt, then k = 0 steps
        width = max(len(p) + r.max_new_tokens for p, r in zip(prompts, sampling.params)) + 2
        self.draft_pending = np.zeros((batch, width), np.int32)
        self.draft_count = np.ones(batch, np.int32)
        self.draft_length = np.zeros(batch, np.int32)
        if draft is not None:
            pending = draft.pending.numpy()
            self.draft_pending[:, : pending.shape[1]] = pending
            self.draft_count[:] = draft.pending_count
            self.draft_length[:] = self.draft_cache.host_lengths
        self.target_pending = np.asarray([p[-1] for p in prompts], np.int32)
        self.target_length = np.asarray(cache.host_lengths, np.int32)
        self.active = np.ones(batch, np.uint8)
        self.proposals = np.zeros(batch * max(k_max, 1), np.int32)
        self.output = np.zeros(batch * (k_max + 1), np.int32)
        self.num_accepted = np.zeros(batch, np.int32)
        self.seconds = np.zeros(2)
        sampled = not params.greedy
        vocab = target.vocab_size if sampled else 0
        self.rng = sampling.streams.keys.numpy().view(np.uint64).copy()  # row b's splitmix64 state: its stream's key
        self.draft_probs = np.zeros(batch * k_max * vocab, np.float32)  # q of every proposal (T > 0)
        self.scratch = np.zeros(2 * vocab, np.float32)
        self.beta = np.zeros(batch * max(k_max, 1), np.float64)
        context = cache.context
        self._args = _StepArgs(
            draft=self.draft_cache.context.ptr if draft is not None else None,
            draft_batch=ctypes.addressof(self._batches[0]),
            target=context.ptr,
            target_batch=ctypes.addressof(self._batches[1]),
            capacity=self.capacity,
            rows=batch,
            active=self.active.ctypes.data,
            k=0,
            p_min=draft.confidence_threshold if draft is not None else 0.0,
            temperature=params.temperature if sampled else 0.0,
            rng=self.rng.ctypes.data,
            draft_probs=self.draft_probs.ctypes.data,
            scratch=self.scratch.ctypes.data,
            beta=self.beta.ctypes.data,
            draft_pending=self.draft_pending.ctypes.data,
            width=width,
            draft_count=self.draft_count.ctypes.data,
            draft_length=self.draft_length.ctypes.data,
            target_pending=self.target_pending.ctypes.data,
            target_length=self.target_length.ctypes.data,
            proposals=self.proposals.ctypes.data,
            output=self.output.ctypes.data,
            num_accepted=self.num_accepted.ctypes.data,
            seconds=self.seconds.ctypes.data,
            invariant=0 if not context.invariant else 2 if context.pad_always else 1,
        )

    @classmethod
    def maybe(
        cls, target, cache, drafter: DraftSource | None, sampling, prompts: list[list[int]], k_max: int
    ) -> CompiledStep | None:
        params = sampling.shared  # one setting for every row (seeds aside), or None
        if params is None or not isinstance(cache, LlamaCppCache):
            return None
        draft = None
        if drafter is not None:
            draft = drafter.own_model() if hasattr(drafter, "own_model") else None
            if draft is None or not isinstance(draft.cache, LlamaCppCache):
                return None
            if not params.greedy and draft.model.vocab_size != target.vocab_size:
                return None
        filtered = (0 < params.top_k < target.vocab_size) or params.top_p < 1.0 or params.min_p > 0.0
        if not (params.greedy or (params.sampling == "rejection" and not filtered)):
            return None
        loaded = _load()
        if loaded is None or len(prompts) * (k_max + 1) > _capacity(cache, draft):
            return None
        if cache.seqs != list(range(len(prompts))) or (draft is not None and draft.cache.seqs != cache.seqs):
            return None  # the C step takes row b to be sequence b in both contexts
        return cls(loaded, target, cache, draft, prompts, sampling, k_max)

    def run(self, k: int, pending: torch.Tensor | None = None, logprobs: dict[int, int] | None = None) -> tuple:
        """One iteration of the active rows: the fields of step.Iteration, in its order (this
        package sits below the engine, so a plain tuple). `pending` and `logprobs` are the Python
        path's: this step keeps its own pending tokens and offers no log-probabilities."""
        started, before = time.perf_counter(), self.seconds.tolist()
        made = self._call(k)
        if made == _TOO_MANY_TOKENS and self.draft is not None:  # the draft's pending tokens do not fit in one batch
            self._read_pending()
            made = self._call(k)
        if made == _TOO_MANY_TOKENS:
            raise RuntimeError(f"a step of {k} proposals does not fit in one llama.cpp batch of {self.capacity} tokens")
        if made < 0:
            raise RuntimeError(f"llama_decode failed (status {-1000 - made}): {log_tail()}")
        drafted, verified = self.seconds[0] - before[0], self.seconds[1] - before[1]
        self.target.forward_compute_s += verified
        self.cache.set_lengths(self.target_length.tolist())
        if self.draft is not None:
            self.draft.forward_compute_s += drafted
            self.draft_cache.set_lengths(self.draft_length.tolist())
        accepted = self.num_accepted.tolist()
        rows = self.output[: len(accepted) * (k + 1)].reshape(-1, k + 1).tolist()  # row b at b * (k + 1)
        tokens = [row[: n + 1] if live else [] for row, n, live in zip(rows, accepted, self.active)]
        betas = self.beta[: len(accepted) * k].reshape(-1, k).tolist() if k else [[] for _ in accepted]
        beta = [row[: min(n + 1, made)] for row, n in zip(betas, accepted)]  # the verified positions
        return tokens, accepted, beta, made, drafted, time.perf_counter() - started - drafted, {}

    def commit(self, accepted: list[int], pending: torch.Tensor, live: list[bool]) -> None:
        """Nothing: `run` rolled both caches back and keeps the pending tokens itself."""

    def _call(self, k: int) -> int:
        self._args.k = k
        return self._function(ctypes.byref(self._args))

    def _read_pending(self) -> None:
        """The draft reads every active row's pending tokens but the last (in batches of any size)."""
        rows = [b for b in np.flatnonzero(self.active) if self.draft_count[b] > 1]
        if not rows:
            return
        tokens = np.concatenate([self.draft_pending[b, : self.draft_count[b] - 1] for b in rows])
        positions = np.concatenate([self.draft_length[b] + np.arange(self.draft_count[b] - 1) for b in rows])
        seqs = np.concatenate([np.full(self.draft_count[b] - 1, b) for b in rows])
        self.draft_cache.context.decode(tokens, positions, seqs, False)
        for b in rows:
            self.draft_length[b] += self.draft_count[b] - 1
            self.draft_pending[b, 0] = self.draft_pending[b, self.draft_count[b] - 1]
            self.draft_count[b] = 1

    def retire(self, rows: list[int]) -> None:
        """Rows that are done: no part in later steps (their caches keep what they hold)."""
        self.active[rows] = 0

    def __del__(self) -> None:
        if not sys.is_finalizing():
            for batch in self._batches:
                self._lib.llama_batch_free(batch)
