"""Text <-> token ids with a GGUF's own vocabulary, through llama.cpp's tokenizer.

Owns `GGUFTokenizer` and its `Encoding`. Knows nothing of passes, caches or speculation.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

from .lib import library
from .model import LlamaCppModel


class Encoding(NamedTuple):
    ids: list[int]


class GGUFTokenizer:
    """Text <-> token ids with a GGUF's own vocabulary (llama.cpp's tokenizer), shaped like the
    `tokenizers` calls verispec makes: `encode(text).ids` and `decode(ids, skip_special_tokens)`.
    Nothing is added (no BOS): the ids are the text's own, as with a Hugging Face tokenizer.json."""

    def __init__(self, model: LlamaCppModel):
        self.model = model  # keeps the vocabulary alive

    def encode(self, text: str) -> Encoding:
        lib, data = library(), text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            buffer = (lib.llama_token * capacity)()
            count = lib.llama_tokenize(self.model.vocab, data, len(data), buffer, capacity, False, True)
            if count >= 0:
                return Encoding(list(buffer[:count]))
            capacity = -count

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        lib = library()
        tokens = (lib.llama_token * max(len(ids), 1))(*ids)
        capacity = 8 * len(ids) + 16
        while True:
            buffer = ctypes.create_string_buffer(capacity)
            count = lib.llama_detokenize(
                self.model.vocab, tokens, len(ids), buffer, capacity, False, not skip_special_tokens
            )
            if count >= 0:
                return buffer.raw[:count].decode("utf-8", errors="replace")
            capacity = -count
