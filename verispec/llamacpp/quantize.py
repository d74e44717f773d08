"""GGUF -> GGUF in another type, through llama.cpp's own quantizer (`llama_model_quantize`).

Owns `QUANT_TYPES` (the names `llama-quantize` takes, mapped to llama.cpp's file types) and
`quantize` (one file in, one file out, written beside the output and renamed into place). The
file is exactly what `llama-quantize IN OUT TYPE` writes: the same mixes per tensor (Q4_K_M keeps
some tensors in Q6_K, a matrix whose rows are not whole blocks falls back as llama.cpp decides).
Types that need an importance matrix (IQ1/IQ2/IQ3) are not offered: verispec has none to give.

Knows nothing of how a file is run.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from ..models.checkpoint import CheckpointError
from .lib import clear_log, default_threads, library, log_tail

# llama-quantize's names (case-insensitive here) -> llama.cpp's LLAMA_FTYPE_* suffix
QUANT_TYPES = {
    "F32": "ALL_F32",
    "F16": "MOSTLY_F16",
    "BF16": "MOSTLY_BF16",
    "Q8_0": "MOSTLY_Q8_0",
    "Q4_0": "MOSTLY_Q4_0",
    "Q4_1": "MOSTLY_Q4_1",
    "Q5_0": "MOSTLY_Q5_0",
    "Q5_1": "MOSTLY_Q5_1",
    "Q2_K": "MOSTLY_Q2_K",
    "Q3_K_S": "MOSTLY_Q3_K_S",
    "Q3_K_M": "MOSTLY_Q3_K_M",
    "Q3_K_L": "MOSTLY_Q3_K_L",
    "Q4_K_S": "MOSTLY_Q4_K_S",
    "Q4_K_M": "MOSTLY_Q4_K_M",
    "Q5_K_S": "MOSTLY_Q5_K_S",
    "Q5_K_M": "MOSTLY_Q5_K_M",
    "Q6_K": "MOSTLY_Q6_K",
    "IQ4_NL": "MOSTLY_IQ4_NL",
    "IQ4_XS": "MOSTLY_IQ4_XS",
}


def quant_type(name: str) -> str:
    """The canonical (upper-case) name of a llama-quantize type; ValueError naming the choices."""
    upper = name.upper()
    if upper not in QUANT_TYPES:
        raise ValueError(f"type must be one of {', '.join(QUANT_TYPES)} (any case), got {name!r}")
    return upper


def quantize(
    source: str | Path, out: str | Path, type: str, threads: int | None = None, head_type: int | None = None
) -> Path:
    """Write the GGUF `source` as `out` in `type` with llama.cpp's quantizer. A file already in a
    quantized type is requantized (as `llama-quantize --allow-requantize`): quality is then that
    of two roundings, which the caller should say. `head_type` (a ggml type) sets the output head's
    and the token embedding's type (`--output-tensor-type`, `--token-embedding-type`)."""
    ftype = QUANT_TYPES[quant_type(type)]
    source, out = Path(source), Path(out)
    if not source.is_file():
        raise CheckpointError(f"{source}: no such GGUF file")
    lib = library()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_{ftype}")
    params.nthread = threads or default_threads()
    params.allow_requantize = True
    if head_type is not None:
        params.output_tensor_type = params.token_embedding_type = head_type
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    clear_log()
    try:
        status = lib.llama_model_quantize(str(source).encode(), str(temp).encode(), params)
        if status != 0:
            raise CheckpointError(
                f"{source}: llama.cpp could not quantize it to {type}: {log_tail() or f'status {status}'}"
            )
        os.replace(temp, out)
    finally:
        temp.unlink(missing_ok=True)
    return out
