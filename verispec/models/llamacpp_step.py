"""The speculative iteration on a llama.cpp target and a llama.cpp draft, in one compiled call.

Owns `CompiledStep` (the state of one `generate` call: both models' pending tokens and
lengths as arrays the compiled step reads and writes) and `step_status()` (whether the
compiled step is in use here, or why not). csrc/llama_step.c does what the engine's Python
path does with a `ModelDrafter` (propose, score, the accept-reject rule, both rollbacks), in
C against llama.cpp's C API: between two target passes Python runs cold (the pass streams
the weights through the caches), and the dozen Python and torch steps of an iteration cost
about 1 ms there. At temperature 0 it is `greedy_continuation`, `forward_argmax` and
`rejection.verify_greedy`; at T > 0 without top-k, top-p or min-p it is
`rejection.verify` on softmax(logits / T), with its own random stream. The Python path stays
the reference: tests compare the two token for token at T = 0, and the exactness suite runs
the compiled rule at T > 0.

The library is compiled on first use (a C compiler and llama-cpp-python's installed
`llama.h`; under a second) into a directory keyed by the source's hash, llama.cpp's version,
the flags and this CPU's, beside the kernels. Where that fails, or `VERISPEC_LLAMA_STEP=0`,
the engine uses its Python path and `step_status()` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from . import llamacpp
from .kernels import cache_root

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "llama_step.c"
_CFLAGS = ["-O3", "-march=native", "-ffast-math"]  # compile only: linking with -ffast-math would set flush-to-zero process-wide
_TOO_MANY_TOKENS = -1
_function = None
_status = "not loaded"


def _headers() -> Path | None:
    import llama_cpp

    package = Path(llama_cpp.__file__).resolve().parent
    for folder in (package.parent / "include", package / "include"):  # where the wheel puts llama.h
        if (folder / "llama.h").is_file():
            return folder
    return None


def _load():
    """The compiled step (a ctypes function), built on first use; None where it cannot be."""
    global _function, _status
    if _status != "not loaded":
        return _function
    if os.environ.get("VERISPEC_LLAMA_STEP", "1") == "0":
        _status = "disabled by VERISPEC_LLAMA_STEP=0"
        return None
    try:
        import llama_cpp

        include, compiler = _headers(), shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        library = Path(llama_cpp.__file__).resolve().parent / "lib"
        if include is None or compiler is None:
            raise RuntimeError("no llama.h beside llama-cpp-python" if include is None else "no C compiler (cc)")
        flags = " ".join(sorted(llamacpp._cpu_flags() or ())).encode()  # built for this CPU (-march=native)
        key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), (include / "llama.h").read_bytes(), llama_cpp.__version__.encode(),
                                         " ".join(_CFLAGS).encode(), flags])).hexdigest()[:16]
        target = cache_root() / f"llama_step-{key}" / "llama_step.so"
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            for command in ([compiler, *_CFLAGS, "-fPIC", "-c", f"-I{include}", str(_SOURCE), "-o", f"{partial}.o"],  # fast math here,
                            [compiler, "-shared", f"{partial}.o", f"-L{library}", "-lllama", f"-Wl,-rpath,{library}", "-lm", "-o", str(partial)]):  # not here
                done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
                if done.returncode != 0:
                    raise RuntimeError(f"the compiler failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:200]}")
            Path(f"{partial}.o").unlink()
            os.replace(partial, target)  # atomic: another process never loads half a library
        llamacpp._llama()  # llama.cpp's library loaded first: ours links to the same one
        function = ctypes.CDLL(str(target)).verispec_step
        function.restype = ctypes.c_int32
        function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int32] * 2 + [ctypes.c_void_p, ctypes.c_int32] + [ctypes.c_float] * 2 + \
            [ctypes.c_void_p] * 5 + [ctypes.c_int32] + [ctypes.c_void_p] * 8 + [ctypes.c_int32]
        _function, _status = function, f"compiled step loaded ({target.parent})"
    except Exception as error:  # no compiler, no header, ...: the engine's Python path; said once
        _status = f"compiled step unavailable ({type(error).__name__}: {str(error)[:200]})"
        print(f"verispec: {_status}; using the Python path", file=sys.stderr, flush=True)
    return _function


def step_status() -> str:
    _load()
    return _status


def _address(array: np.ndarray) -> int:
    return array.ctypes.data


def _capacity(cache, drafter) -> int:
    """Tokens one llama_decode takes in both contexts (the C step fills both batches up to it)."""
    return min(cache.context.n_batch, drafter.cache.context.n_batch) if drafter is not None else cache.context.n_batch


class CompiledStep:
    """Both models' state for the compiled step, over the caches of one `generate` call.

    `maybe(target, cache, drafter, sampling, prompts, k_max)` returns one when it applies (a
    `LlamaCppModel` target; a `ModelDrafter` over a `LlamaCppModel` of the same vocabulary, or
    no drafter: plain decoding; every row with the same settings: temperature 0, or rejection
    sampling at a temperature with no top-k, top-p or min-p; the compiled step loaded; B*(k+1)
    positions in one llama.cpp batch of both contexts); `step(k)` runs one iteration for
    the active rows and returns (committed tokens per row, num_accepted per row, beta per row,
    proposals made, seconds drafting). Rows that finish are `retire`d: they take no part in
    later steps and their caches stop growing. The drafter's own state is read at the start
    and not kept up to date after. At T > 0 row b draws from its own splitmix64
    stream, started where `RowStreams` starts it (so a seed gives the same tokens each run,
    whatever the other rows; not the Python path's tokens, which draw in another order)."""

    def __init__(self, function, target, cache, drafter, prompts: list[list[int]], sampling, k_max: int):
        lib, batch = llamacpp._llama(), len(prompts)
        self._function, self._lib = function, lib
        self.target, self.cache = target, cache
        self.draft, self.draft_cache = (drafter.model, drafter.cache) if drafter is not None else (None, None)
        self.capacity = _capacity(cache, drafter)
        self._batches = [lib.llama_batch_init(self.capacity, 0, 1) for _ in range(2)]
        params = sampling.shared
        width = max(len(p) + r.max_new_tokens for p, r in zip(prompts, sampling.params)) + 2  # pending tokens: a whole prompt, then k = 0 steps
        self.draft_pending = np.zeros((batch, width), np.int32)
        self.draft_count = np.ones(batch, np.int32)
        self.draft_length = np.zeros(batch, np.int32)
        if drafter is not None:
            pending = drafter.pending.numpy()
            self.draft_pending[:, : pending.shape[1]] = pending
            self.draft_count[:] = drafter.pending_count
            self.draft_length[:] = self.draft_cache.host_lengths
        self.target_pending = np.asarray([p[-1] for p in prompts], np.int32)
        self.target_length = np.asarray(cache.host_lengths, np.int32)
        self.active = np.ones(batch, np.uint8)
        self.proposals = np.zeros(batch * max(k_max, 1), np.int32)
        self.output = np.zeros(batch * (k_max + 1), np.int32)
        self.num_accepted = np.zeros(batch, np.int32)
        self.seconds = np.zeros(2)
        self.sampled = not params.greedy
        vocab = target.vocab_size if self.sampled else 0
        self.rng = sampling.streams.keys.numpy().view(np.uint64).copy()  # row b's splitmix64 state: its stream's key
        self.draft_probs = np.zeros(batch * k_max * vocab, np.float32)  # q of every proposal (T > 0)
        self.scratch = np.zeros(2 * vocab, np.float32)
        self.beta = np.zeros(batch * max(k_max, 1), np.float64)
        self._head = (self.draft_cache.context.ptr if drafter is not None else None, ctypes.addressof(self._batches[0]), cache.context.ptr,
                      ctypes.addressof(self._batches[1]), self.capacity, batch, _address(self.active))
        self._settings = (ctypes.c_float(getattr(drafter, "confidence_threshold", 0.0)), ctypes.c_float(params.temperature if self.sampled else 0.0),
                          *map(_address, (self.rng, self.draft_probs, self.scratch, self.beta, self.draft_pending)), width)
        self._arrays = (*map(_address, (self.draft_count, self.draft_length, self.target_pending, self.target_length,
                                        self.proposals, self.output, self.num_accepted, self.seconds)),
                       0 if not cache.context.invariant else 2 if cache.context.pad_always else 1)

    @classmethod
    def maybe(cls, target, cache, drafter, sampling, prompts: list[list[int]], k_max: int) -> CompiledStep | None:
        from ..drafters.model import ModelDrafter

        params = sampling.shared  # one setting for every row (seeds aside), or None
        if params is None:
            return None
        draft = getattr(drafter, "model", None)
        filtered = (0 < params.top_k < target.vocab_size) or params.top_p < 1.0 or params.min_p > 0.0
        drafts = drafter is None or (type(drafter) is ModelDrafter and isinstance(draft, llamacpp.LlamaCppModel)
                                     and (params.greedy or draft.vocab_size == target.vocab_size))
        if not (isinstance(target, llamacpp.LlamaCppModel) and drafts and (params.greedy or (params.sampling == "rejection" and not filtered))):
            return None
        function = _load()
        if function is None or len(prompts) * (k_max + 1) > _capacity(cache, drafter):
            return None
        if cache.seqs != list(range(len(prompts))) or (drafter is not None and drafter.cache.seqs != cache.seqs):
            return None  # the C step takes row b to be sequence b in both contexts
        return cls(function, target, cache, drafter, prompts, sampling, k_max)

    def step(self, k: int) -> tuple[list[list[int]], list[int], list[list[float]], int, float]:
        """One iteration of the active rows: (committed tokens [B][n_b + 1] (inactive rows: []),
        num_accepted [B], beta [B][k'] (verified positions; q one-hot at T = 0), proposals made
        k' (k, or fewer after a confidence stop), seconds drafting)."""
        before = self.seconds.tolist()
        made = self._call(k)
        if made == _TOO_MANY_TOKENS and self.draft is not None:  # the draft's pending tokens do not fit in one batch: read them first
            self._read_pending()
            made = self._call(k)
        if made == _TOO_MANY_TOKENS:
            raise RuntimeError(f"a step of {k} proposals does not fit in one llama.cpp batch of {self.capacity} tokens")
        if made < 0:
            raise RuntimeError(f"llama_decode failed (status {-1000 - made}): {' / '.join(llamacpp._log[-2:])}")
        drafted, verified = self.seconds[0] - before[0], self.seconds[1] - before[1]
        self.target.forward_compute_s += verified
        self.cache.set_lengths(self.target_length.tolist())
        if self.draft is not None:
            self.draft.forward_compute_s += drafted
            self.draft_cache.set_lengths(self.draft_length.tolist())
        accepted = self.num_accepted.tolist()
        rows = self.output[: len(accepted) * (k + 1)].reshape(-1, k + 1).tolist()  # row b at b * (k + 1), whatever was made
        tokens = [row[: n + 1] if live else [] for row, n, live in zip(rows, accepted, self.active)]
        if self.sampled:
            beta = self.beta[: len(accepted) * k].reshape(-1, k)[:, :made].tolist() if k else [[] for _ in accepted]
        else:  # q one-hot at the proposal: beta is 1 where it is the target's argmax, 0 at the first that is not
            beta = [[1.0] * n + [0.0] * (made - n) for n in accepted]
        return tokens, accepted, beta, made, drafted

    def _call(self, k: int) -> int:
        return self._function(*self._head, k, *self._settings, *self._arrays)

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
