"""llama.cpp's library, loaded once through llama-cpp-python, and the process-wide settings.

Owns `library()` (the `llama_cpp` module, its backend initialised and its log captured),
`log_tail` / `clear_log` (llama.cpp's recent error lines: its log is silenced, errors are quoted
in ours), `unavailable()` (why llama.cpp cannot run here, or None), `cpu_flags()` (this CPU's
instruction sets), `cpu_name`, `system_info`, `default_threads`, and the exact-kernels setting
(`set_exact_kernels`, `exact_kernels`). Knows nothing of models, caches or speculation.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

_CPU_FLAGS = {  # llama_print_system_info() names -> /proc/cpuinfo flags
    "AVX": "avx",
    "AVX2": "avx2",
    "F16C": "f16c",
    "FMA": "fma",
    "BMI2": "bmi2",
    "AVX_VNNI": "avx_vnni",
    "AVX512": "avx512f",
    "AVX512_VBMI": "avx512vbmi",
    "AVX512_VNNI": "avx512_vnni",
    "AVX512_BF16": "avx512_bf16",
    "AMX_INT8": "amx_int8",
}
_lib = None
_exact_kernels = True  # process-wide: set_exact_kernels, before llama.cpp's library is initialised
_log: list[str] = []  # llama.cpp's recent error lines


def library():
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
        if extra_buffers_fault(llama_cpp):
            _without_extra_buffers(llama_cpp)
        _lib = llama_cpp
    return _lib


def log_tail(lines: int = 2) -> str:
    """llama.cpp's last error lines, joined by ' / ' ('' when there are none)."""
    return " / ".join(_log[-lines:])


def clear_log() -> None:
    """Forget llama.cpp's earlier error lines (before a call whose errors are to be quoted)."""
    _log.clear()


def set_exact_kernels(on: bool) -> None:
    """Choose llama.cpp's settings for the whole process, before its first model loads.

    On (the default): a position's logits do not depend on the pass that computes them (how
    many positions or rows it holds, placeholders, the cache's size), so that speculative
    decoding gives plain decoding's tokens on every GGUF type. It takes three settings, each
    found by measuring (`deviation.pass_shape_deviation`; docs/EXACTNESS.md):
    - weights not repacked (`use_extra_bufts` off): repacked types run a GEMV kernel for one
      position and a GEMM kernel for more;
    - ggml's tiled K-quant/IQ product off (`GGML_CPU_TILED_MM=0`, read once by ggml): it takes
      passes of 8 positions or more, the dot-product kernel the rest;
    - placeholder tokens (`LlamaCppModel.shape_invariant`, context.py) under one of two
      attentions per file (regime.py, `--flash-attn`): sgemm's attention (flash attention off)
      with no sequence of one token in a target pass (its products of one query per sequence
      take another kernel than those of several); or flash attention, each query on its own,
      with a placeholder after a one-token pass where it would split a query's cells or where
      llamafile's sgemm takes a matrix of the file (f32, f16, bf16, q8_0, ...: 2 columns or more).
    Off: llama.cpp's defaults for the kernels (repacking, the tiled product), no placeholders;
    faster on some types, exact only where the measured deviation is 0.
    """
    global _exact_kernels
    if _lib is not None and bool(on) != _exact_kernels:
        raise RuntimeError("set_exact_kernels must be called before the first llama.cpp model loads")
    _exact_kernels = bool(on)


def exact_kernels() -> bool:
    return _exact_kernels


def extra_buffers_fault(llama_cpp=None) -> bool:
    """Whether llama.cpp runs here without its extra CPU buffer types (AMX, repacked weights): a build with
    AMX_INT8 can die of SIGILL through the AMX buffer type. llama.cpp's own programs, run as peers, then take
    `--no-repack` (the same setting, so both sides run the same kernels)."""
    if llama_cpp is None:
        try:
            import llama_cpp
        except ImportError:
            return False
    return "AMX" in llama_cpp.llama_print_system_info().decode(errors="replace")


def _without_extra_buffers(llama_cpp) -> None:
    """Models load without llama.cpp's extra CPU buffer types (AMX, repacked weights), for every
    caller of llama_model_default_params (llama-cpp-python's `Llama` included): a build with
    AMX_INT8 can die of SIGILL on the first decode of a q8_0 or q4_0 file through the AMX buffer
    type on a CPU whose flags list it, and runs with it off."""
    default = llama_cpp.llama_cpp.llama_model_default_params

    def model_params():
        params = default()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = llama_cpp.llama_model_default_params = model_params


def cpu_name() -> str:
    """This CPU's model name from /proc/cpuinfo ('' where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")


def cpu_flags() -> set[str] | None:
    """This CPU's flags from /proc/cpuinfo (None where it cannot be read)."""
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
        lib = library()
    except ImportError:
        return "llama-cpp-python is not installed (pip install 'verispec[llamacpp]')"
    except OSError as error:
        return f"llama.cpp's library does not load: {error}"
    flags = cpu_flags()
    if flags is not None:
        info = lib.llama_print_system_info().decode(errors="replace")
        built = [name for name, flag in _CPU_FLAGS.items() if f" {name} = 1 " in f" {info} ".replace("|", " ")]
        missing = [name for name in built if _CPU_FLAGS[name] not in flags]
        if missing:
            return (
                f"this llama.cpp was built for {', '.join(missing)}, which this CPU lacks "
                "(rebuild it here: pip install --force-reinstall --no-cache-dir llama-cpp-python)"
            )
    return None


def system_info() -> str:
    """llama.cpp's own line on what it was built with (instruction sets, OpenMP, ...)."""
    return library().llama_print_system_info().decode(errors="replace").strip()


def default_threads() -> int:
    """The cores this process may run on: llama.cpp's threads, never more (no oversubscription)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
