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
    `tokenizers` calls verispec makes: `encode(text, add_special_tokens).ids` and
    `decode(ids, skip_special_tokens)`.

    A prompt is tokenized as llama.cpp tokenizes it (`llama_tokenize(..., add_special=True,
    parse_special=True)`, what llama-cpp-python's `Llama` does with a text prompt): a BOS and an
    EOS where the file's metadata says so (`tokenizer.ggml.add_bos_token`, `add_eos_token`), and
    special tokens written in the text (`<|im_start|>`) read as themselves. `add_special_tokens=False`
    gives a text's own ids (a continuation re-encoded), as with a Hugging Face tokenizer.json."""

    def __init__(self, model: LlamaCppModel):
        self.model = model  # keeps the vocabulary alive
        lib = library()
        self.adds_bos = bool(lib.llama_vocab_get_add_bos(model.vocab))
        self.adds_eos = bool(lib.llama_vocab_get_add_eos(model.vocab))
        bos = int(lib.llama_vocab_bos(model.vocab))
        self.bos_token_id = bos if bos >= 0 else None

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        lib, data = library(), text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            buffer = (lib.llama_token * capacity)()
            count = lib.llama_tokenize(self.model.vocab, data, len(data), buffer, capacity, add_special_tokens, True)
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
