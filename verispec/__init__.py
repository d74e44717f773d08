"""verispec: exact (lossless) speculative decoding on llama.cpp and PyTorch.

The public API, re-exported. See docs/ARCHITECTURE.md for which module owns what.
"""

from .config import SamplingParams, SpecConfig
from .control import AdaptiveLength, DraftLengthPolicy, FixedLength
from .drafters.base import Drafter
from .drafters.early_exit import EarlyExitDrafter
from .drafters.model import ModelDrafter
from .drafters.ngram import PromptLookupDrafter
from .engine import generate, generate_all
from .models.backend import load, load_text_tokenizer
from .models.checkpoint import CheckpointError, load_pretrained, save_pretrained
from .models.llama import KVCache, LlamaConfig, LlamaForCausalLM
from .rejection import acceptance_probability, verify
from .sampling import process_logits, sample
from .stats import RequestStats, SpecStats

__version__ = "0.1.0"

__all__ = [
    "AdaptiveLength", "DraftLengthPolicy", "FixedLength",
    "CheckpointError", "Drafter", "KVCache", "LlamaConfig", "LlamaForCausalLM", "EarlyExitDrafter", "ModelDrafter", "PromptLookupDrafter", "RequestStats",
    "SamplingParams", "SpecConfig", "SpecStats", "acceptance_probability", "generate", "generate_all",
    "load", "load_pretrained", "load_text_tokenizer", "process_logits", "sample", "save_pretrained", "verify",
]
