"""llama_step.c as a library: built on first use, loaded once, its C structs mirrored.

Owns `load()` (the compiled library, built first where the cache does not hold it, or None),
`step_status()` (whether it is in use here, or why not), the ctypes mirrors of its argument
structs (`StepArgs` for `verispec_step`, which llamacpp/step.py's `CompiledStep` fills) and the
rule alone on given inputs (`compiled_rule`, `compiled_process`) for the tests that compare it with
`rejection.verify_batch` and `sampling.process_logits`.

The library is compiled (a C compiler and llama-cpp-python's installed `llama.h`; under a
second) into a directory keyed by the source's hash, llama.cpp's version, the flags and this
CPU's, beside the kernels. Where that fails, or `VERISPEC_LLAMA_STEP=0`, the engine uses its
Python path and `step_status()` says why. Knows nothing of models, drafters or the engine.
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

from ..models.kernels import cache_root
from ..paths import notice
from .lib import cpu_flags, library

_SOURCE = Path(__file__).resolve().parent / "llama_step.c"
_SOURCES = tuple(_SOURCE.with_name(n) for n in ("llama_step.c", "head.c", "head.h", "kernels.c"))  # one library
# compile only: linking with -ffast-math would set flush-to-zero process-wide
_CFLAGS = ["-O3", "-march=native", "-ffast-math"]
_library = None
_status = "not loaded"

_p = ctypes.c_void_p


class StepArgs(ctypes.Structure):
    """`struct verispec_step_args` of llama_step.c, field by field in the same order (new fields at the end)."""

    _fields_ = [
        ("draft", _p),  # the draft's llama_context, or NULL: plain decoding (k = 0 only)
        ("draft_batch", _p),  # the draft's llama_batch of `capacity` tokens (NULL without a draft)
        ("target", _p),  # the target's llama_context
        ("target_batch", _p),  # the target's llama_batch of `capacity` tokens
        ("capacity", ctypes.c_int32),  # tokens one batch holds
        ("rows", ctypes.c_int32),  # slots of the batch; slot b is llama.cpp sequence b in both contexts
        ("active", _p),  # uint8 [rows]: 0 where the row finished (it takes no part)
        ("k", ctypes.c_int32),  # proposals wanted this step (0: a plain step); set before each call
        ("p_min", ctypes.c_float),  # the draft's confidence threshold (0: off)
        ("sampling", _p),  # struct verispec_sampling [rows]: each row's settings (temperature 0: greedy)
        ("rng", _p),  # uint64 [rows]: each row's splitmix64 state
        ("draft_probs", _p),  # float32 [rows, k, V]: q of every proposal, processed, not sharpened (T > 0)
        ("scratch", _p),  # float32 [4 V]: one position's p and three arrays in its support's order (T > 0)
        ("beta", _p),  # float64 [rows, k] out: sum min(p, q') at each verified position, q' what x was drawn from
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
        ("invariant", ctypes.c_int32),  # 0: ordinary; 1: flash, placeholders (4: a spare sequence); 2: sgemm; 3: lone
        ("taus", _p),  # float32 [rows]: each row's proposal temperature (proposal.py), or NULL: 1 (q itself)
        ("grid_taus", _p),  # float32 [grid_size]: the grid whose acceptance the rule measures
        ("grid_size", ctypes.c_int32),  # 0: none (a fixed tau)
        ("grid", _p),  # float64 [rows, k, grid_size] out: sum min(p, q'_tau) at each verified position
        ("draft_top", _p),  # int32 [rows, k]: q's argmax at every proposal (T > 0)
        ("draft_norms", _p),  # float32 [rows, k, 1 + grid_size]: the proposals' normalisers (T > 0)
        ("index", _p),  # int32 [3 V + 2] scratch (T > 0)
        ("tell_q", ctypes.c_int32),  # 1: the rule is told q, not what drew the proposal (a negative control)
        ("first_at", _p),  # int32 [rows] out: each row's first place in the target's batch (-1: not in it)
        ("given", _p),  # int32 [rows, k]: proposals made outside (a lookup; q one-hot): every row's, or with a draft
        # the rows given_rows names (a combined draft); or NULL
        ("given_rows", _p),  # uint8 [rows]: with a draft, 1 where the row takes its given proposals; or NULL
        ("head", _p),  # struct verispec_head * of the target's context (head.py), or NULL: llama.cpp's head
        ("head_logits", _p),  # float32 [outputs, V] with head: the target's logits; first_at indexes its rows
    ]


class Sampling(ctypes.Structure):
    """`struct verispec_sampling`: process_logits's settings at T > 0."""

    _fields_ = [
        ("temperature", ctypes.c_float),
        ("top_k", ctypes.c_int32),
        ("top_p", ctypes.c_float),
        ("min_p", ctypes.c_float),
    ]


class _RuleArgs(ctypes.Structure):
    """`struct verispec_rule_args`: one row's rule on given inputs."""

    _fields_ = [
        ("logits", _p),  # const float *[drafted + 1]
        ("proposals", _p),
        ("draft_probs", _p),
        ("drafted", ctypes.c_int32),
        ("vocab", ctypes.c_int32),
        ("sampling", Sampling),
        ("tau", ctypes.c_float),
        ("grid_taus", _p),
        ("grid_size", ctypes.c_int32),
        ("scratch", _p),
        ("index", _p),
        ("rng", _p),
        ("given", _p),
        ("output", _p),
        ("beta", _p),
        ("grid", _p),
        ("coupled", ctypes.c_int32),  # 1: q one-hot at the proposals (draft_probs unread)
    ]


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
                *(source.read_bytes() for source in _SOURCES),
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
    notice(f"building the compiled step into {target.parent} (once per llama.cpp build; about 20 s)")
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    objects = [f"{partial}.{source.stem}.o" for source in _SOURCES if source.suffix == ".c"]
    compile_each = [
        [compiler, *_CFLAGS, "-fopenmp", "-fPIC", "-c", f"-I{include}", str(source), "-o", obj]  # fast math here,
        for source, obj in zip((s for s in _SOURCES if s.suffix == ".c"), objects)
    ]
    link = [compiler, "-shared", "-fopenmp", *objects, f"-L{lib_dir}", "-lllama", "-lggml-cpu", "-lggml-base"]
    for command in (*compile_each, [*link, f"-Wl,-rpath,{lib_dir}", "-lm", "-o", str(partial)]):  # not here
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the compiler failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:200]}")
    for obj in objects:
        Path(obj).unlink()
    os.replace(partial, target)  # atomic: another process never loads half a library
    return target


def load():
    """The compiled library (ctypes, its functions typed), built on first use; None where it cannot be."""
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
        loaded.verispec_step.argtypes = [ctypes.POINTER(StepArgs)]
        loaded.verispec_rule.restype = ctypes.c_int32
        loaded.verispec_rule.argtypes = [ctypes.POINTER(_RuleArgs)]
        loaded.verispec_process.restype = ctypes.c_int32
        loaded.verispec_process.argtypes = [_p, ctypes.c_int32, ctypes.POINTER(Sampling), _p, _p]
        loaded.verispec_head_supported.restype = ctypes.c_int32
        loaded.verispec_head_supported.argtypes = [ctypes.c_int32]
        loaded.verispec_head_row_bytes.restype = ctypes.c_int64
        loaded.verispec_head_row_bytes.argtypes = [ctypes.c_int32, ctypes.c_int32]
        loaded.verispec_head_logits.restype = None
        loaded.verispec_head_logits.argtypes = [_p, ctypes.c_int32, _p]
        loaded.verispec_one_kernel.restype = ctypes.c_int32
        loaded.verispec_one_kernel.argtypes = [ctypes.c_int32] * 5
        _library, _status = loaded, f"compiled step loaded ({target.parent})"
    except Exception as error:  # no compiler, no header, ...: the engine's Python path; said once
        _status = f"compiled step unavailable ({type(error).__name__}: {str(error)[:200]})"
        print(f"verispec: {_status}; using the Python path", file=sys.stderr, flush=True)
    return _library


def step_status() -> str:
    """`compiled step loaded (its directory)` where the engine runs llama.cpp iterations as one C call
    (each row greedy or rejection sampling with its own top-k, top-p and min-p, the draft proposing
    from q sharpened by its proposal temperature), else why not."""
    load()
    return _status


def _loaded():
    loaded = load()
    if loaded is None:
        raise RuntimeError(f"the compiled rule is not available: {_status}")
    return loaded


def sampling_struct(params) -> Sampling:
    """A SamplingParams as `struct verispec_sampling` (temperature 0 where it is greedy)."""
    if params.greedy:
        return Sampling(0.0, 0, 1.0, 0.0)
    return Sampling(params.temperature, params.top_k, params.top_p, params.min_p)


def compiled_process(logits: np.ndarray, params) -> tuple[np.ndarray, list[int]]:
    """llama_step.c's `process` on one row of raw logits [V] with SamplingParams `params` (T > 0):
    (probs [V] float32, the support's ids in increasing order), to compare with process_logits."""
    logits = np.ascontiguousarray(logits, np.float32)
    vocab = logits.shape[0]
    probs, index = np.zeros(4 * vocab, np.float32), np.zeros(3 * vocab + 2, np.int32)
    n = _loaded().verispec_process(
        logits.ctypes.data, vocab, ctypes.byref(sampling_struct(params)), probs.ctypes.data, index.ctypes.data
    )
    return probs[:vocab].copy(), index[:n].tolist()


def compiled_rule(
    logits: np.ndarray,
    proposals: np.ndarray,
    draft_probs: np.ndarray | None,
    params,
    rng: int = 0,
    uniforms: np.ndarray | None = None,
    tau: float = 1.0,
    grid_taus: tuple[float, ...] = (),
) -> tuple[list[int], int, list[float], int, np.ndarray]:
    """llama_step.c's rule on one row: logits [k+1, V] float32 (the target's raw logits), proposals
    [k], draft_probs [k, V] float32 (q processed, not sharpened; None: q one-hot at the proposals, the
    coupled form of a lookup's proposals at temperature > 0), `params` a
    SamplingParams, the proposals drawn from sharpen(q, tau). Its random numbers are `uniforms`
    [k+1] float64 by role (u_i for the test of position i, u_k for the recovered or bonus draw: the
    roles of `rejection.verify`), or else drawn in turn from a splitmix64 stream in state `rng` (as
    the compiled step draws them). Returns (output tokens [n+1], n accepted, beta at the verified
    positions, the stream's state after, the grid [verified, len(grid_taus)] float64)."""
    loaded = _loaded()
    logits = np.ascontiguousarray(logits, np.float32)
    k, vocab = logits.shape[0] - 1, logits.shape[1]
    rows = (ctypes.c_void_p * (k + 1))(*(logits.ctypes.data + i * logits.strides[0] for i in range(k + 1)))
    proposals = np.ascontiguousarray(proposals, np.int32)
    q = None if draft_probs is None else np.ascontiguousarray(draft_probs, np.float32)
    given = None if uniforms is None else np.ascontiguousarray(uniforms, np.float64)
    taus = np.asarray(grid_taus, np.float32)
    scratch, index = np.zeros(4 * vocab, np.float32), np.zeros(3 * vocab + 2, np.int32)
    state = np.array([rng], np.uint64)
    output, beta = np.full(k + 1, -1, np.int32), np.full(max(k, 1), np.nan)
    grid = np.full((max(k, 1), max(len(taus), 1)), np.nan)
    sampling = sampling_struct(params)
    args = _RuleArgs(
        ctypes.addressof(rows),
        proposals.ctypes.data,
        None if q is None else q.ctypes.data,
        k,
        vocab,
        sampling,
        tau,
        taus.ctypes.data if len(taus) else None,
        len(taus),
        scratch.ctypes.data,
        index.ctypes.data,
        state.ctypes.data,
        None if given is None else given.ctypes.data,
        output.ctypes.data,
        beta.ctypes.data,
        grid.ctypes.data if len(taus) else None,
        int(q is None),
    )
    n = loaded.verispec_rule(ctypes.byref(args))
    verified = min(n + 1, k)
    return output[: n + 1].tolist(), n, beta[:verified].tolist(), int(state[0]), grid[:verified, : len(taus)]
