"""GGUF models on llama.cpp (llama-cpp-python's C API) behind verispec's model protocol.

One concern per module: lib (loading the library, the CPU probe, the exact-kernels setting),
context (a llama.cpp context, its cache and batches, the placeholder rules), regime (which
attention a file runs: the --flash-attn setting, measured per CPU), model
(`LlamaCppModel`), tokenizer (`GGUFTokenizer`), step (the compiled iteration), compiled
(llama_step.c beside it, built and loaded), quantize (llama.cpp's quantizer), deviation
(how much a position's logits depend on the pass) and memo (measurements remembered per file
and machine). Importing this package does not load
llama.cpp: `unavailable()` says whether it can run here. Knows nothing of sampling or
speculation but the compiled step's mirror of them.
"""

from .compiled import compiled_process, compiled_rule, step_status
from .context import MAX_SEQUENCES, LlamaCppCache
from .deviation import Deviation, pass_shape_deviation, startup_deviation
from .lib import default_threads, exact_kernels, set_exact_kernels, system_info, unavailable
from .model import GGUFConfig, LlamaCppModel
from .quantize import QUANT_TYPES, quant_type, quantize
from .step import CompiledStep
from .tokenizer import Encoding, GGUFTokenizer

__all__ = [
    "MAX_SEQUENCES",
    "LlamaCppCache",
    "Deviation",
    "pass_shape_deviation",
    "startup_deviation",
    "default_threads",
    "exact_kernels",
    "set_exact_kernels",
    "system_info",
    "unavailable",
    "GGUFConfig",
    "LlamaCppModel",
    "QUANT_TYPES",
    "quant_type",
    "quantize",
    "CompiledStep",
    "compiled_process",
    "compiled_rule",
    "step_status",
    "Encoding",
    "GGUFTokenizer",
]
