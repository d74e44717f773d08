"""Which engine runs a model: llama.cpp (GGUF) or PyTorch (verispec's Llama, or transformers).

Owns `BACKENDS`, `load` (a model path and a backend name -> a model with the engine's
interface, and a note when `auto` had to fall back) and `load_text_tokenizer`. The rule,
drafters, policies and tools never ask which backend a model runs on; only the loaders here do.

- A `.gguf` file runs on llama.cpp (`LlamaCppModel`), whatever the backend name, except a draft
  of `verispec train draft --target` (`verispec.draft.vocab_ids`): PyTorch runs it with its
  vocabulary-subset head (llama.cpp would compute every row of its full-size head); with
  `--backend llamacpp` it runs on llama.cpp as written.
- A Hugging Face directory runs on PyTorch with `torch`; with `llamacpp` it is converted once to
  GGUF (`gguf_convert.cached_gguf`, keyed by its weights and `gguf_type`) and runs on llama.cpp.
- `auto`: llama.cpp when the device is the CPU, llama.cpp is installed and runs on this CPU,
  and the directory converts (Llama family, float weights); otherwise PyTorch, with a one-line
  note that says why.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import CheckpointError, load_tokenizer
from .gguf_convert import ALL_TYPES as GGUF_TYPES  # the types a directory converts to (llama-quantize's, lower case)

BACKENDS = ("auto", "llamacpp", "torch")


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def _check(backend: str, gguf_type: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if gguf_type.lower() not in GGUF_TYPES:
        raise ValueError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")


def load(
    path: str | Path,
    backend: str = "auto",
    dtype: torch.dtype = torch.float32,
    gguf_type: str = "f32",
    device: str | torch.device = "cpu",
    n_threads: int | None = None,
) -> tuple[object, str | None]:
    """(model, note): the model at `path` on the chosen backend; note says why `auto` fell back
    to PyTorch (None otherwise). Raises CheckpointError (one line) when the path cannot run
    on the backend asked for."""
    from .hf import load_model

    _check(backend, gguf_type)
    if is_gguf(path) and backend != "llamacpp":
        from ..training.draft_export import is_subset_draft, load_subset_draft

        if is_subset_draft(path):  # a draft of `verispec train draft --target`: its subset head runs on torch
            return load_subset_draft(path).to(dtype=dtype, device=device), None
    if is_gguf(path):
        if backend == "torch":
            raise CheckpointError(f"{path}: a GGUF file runs on llama.cpp (--backend llamacpp or auto), not on torch")
        from ..llamacpp import LlamaCppModel

        return LlamaCppModel(path, n_threads), None
    if backend == "torch" or (backend == "auto" and torch.device(device).type != "cpu"):
        return load_model(path, dtype, device), None
    why_not = _llamacpp_unavailable(device)
    if why_not is None:
        from ..llamacpp import LlamaCppModel
        from .gguf_convert import cached_gguf

        try:
            return LlamaCppModel(cached_gguf(path, gguf_type), n_threads), None
        except CheckpointError as error:  # not a Llama-family float directory, say
            if backend == "llamacpp":
                raise
            why_not = str(error)
        except ImportError as error:  # llama-cpp-python without the gguf package
            why_not = f"converting to GGUF needs the gguf package (pip install 'verispec[llamacpp]'): {error}"
    if backend == "llamacpp":
        raise CheckpointError(f"{path}: cannot run on llama.cpp: {why_not}")
    return load_model(path, dtype, device), f"using the torch backend for {path}: {why_not}"


def gguf_file(path: str | Path, gguf_type: str = "f32") -> Path:
    """The GGUF file for `path`: itself, or a directory's cached conversion to gguf_type."""
    _check("llamacpp", gguf_type)
    if is_gguf(path):
        return Path(path)
    from .gguf_convert import cached_gguf

    return cached_gguf(path, gguf_type)


def _llamacpp_unavailable(device: str | torch.device) -> str | None:
    if torch.device(device).type != "cpu":
        return f"the device is {device} (the llama.cpp backend runs on the CPU here)"
    from ..llamacpp import unavailable

    return unavailable()


def load_text_tokenizer(path: str | Path, model):
    """The tokenizer that turns text into the model's ids: a GGUF's own vocabulary (llama.cpp's
    tokenizer), or a directory's tokenizer.json (also for a directory converted to GGUF: the
    conversion keeps its ids, tested). None when a directory has no tokenizer.json."""
    if is_gguf(path):
        from ..llamacpp import GGUFTokenizer

        return GGUFTokenizer(model)
    return load_tokenizer(path)
