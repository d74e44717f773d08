"""verispec: exact (lossless) speculative decoding on llama.cpp and PyTorch.

The public API, re-exported. See docs/ARCHITECTURE.md for which module owns what.
"""

import importlib.util as _util
import os as _os

# llama.cpp's worker threads are OpenMP threads (llama-cpp-python's build). libgomp reads how long a
# thread spins at a barrier before it sleeps once, when it loads, and torch loads the same
# libgomp.so.1: so it is set here, before torch is imported. Its default (300,000 spins) is fast
# alone and ruinous beside another process on the same cores, where 1,000 spins keep llama.cpp
# near its idle speed (benchmarks/shared_cpu.py measures both). Set where llama.cpp is installed
# (the CPU backend of `auto`); torch's own CPU passes are slower with it, so a user of --backend
# torch on the CPU may set GOMP_SPINCOUNT=300000. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept.
if (
    "OMP_WAIT_POLICY" not in _os.environ
    and "GOMP_SPINCOUNT" not in _os.environ
    and _util.find_spec("llama_cpp") is not None
):
    _os.environ["GOMP_SPINCOUNT"] = "1000"

from .config import SamplingParams, SpecConfig
from .drafters.base import Drafter
from .drafters.early_exit import EarlyExitDrafter
from .drafters.model import ModelDrafter
from .drafters.ngram import PromptLookupDrafter
from .drafters.suffix import SuffixDrafter
from .engine import generate, generate_all
from .models.backend import load, load_text_tokenizer
from .models.checkpoint import CheckpointError, load_pretrained, save_pretrained
from .models.llama import KVCache, LlamaConfig, LlamaForCausalLM
from .policy import AdaptiveLength, DraftLengthPolicy, FixedLength
from .rejection import acceptance_probability, verify
from .sampling import process_logits, sample
from .stats import RequestStats, SpecStats

__version__ = "0.1.0"

__all__ = [
    "AdaptiveLength",
    "DraftLengthPolicy",
    "FixedLength",
    "CheckpointError",
    "Drafter",
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
    "EarlyExitDrafter",
    "ModelDrafter",
    "PromptLookupDrafter",
    "RequestStats",
    "SamplingParams",
    "SpecConfig",
    "SpecStats",
    "SuffixDrafter",
    "acceptance_probability",
    "generate",
    "generate_all",
    "load",
    "load_pretrained",
    "load_text_tokenizer",
    "process_logits",
    "sample",
    "save_pretrained",
    "verify",
]
