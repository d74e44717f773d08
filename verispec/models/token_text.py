"""What text each token id stands for, and text -> ids: a tokenizer seen as byte strings.

Owns `TokenText` (per id the exact bytes it decodes to, which ids are special, and an `encode`
of text) and its builders: `token_text_of` for a model directory's tokenizer.json or a GGUF
file's own vocabulary, `text_of_hf` for a `tokenizers.Tokenizer`. Two models with different
tokenizers share a token where both have a token of the same bytes (drafters/cross_vocab.py).

Token strings are turned into bytes by the tokenizer's kind: byte-level BPE (GPT-2's
alphabet: each character stands for one byte) or SentencePiece style ('▁' for a space,
`<0xNN>` for a byte). A special token's bytes are its text, matched only with special tokens
on the other side. Knows nothing of models, sampling or speculation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class TokenText:
    """A tokenizer as byte strings. `pieces[i]`: the bytes id i decodes to (None: no text, e.g. a
    placeholder id); `special`: the ids of special tokens (their piece is their text);
    `encode(text) -> ids` (nothing added: no BOS); `bos`: the id the tokenizer puts before a
    prompt, or None where it adds none."""

    pieces: tuple[bytes | None, ...]
    special: frozenset[int]
    encode: Callable[[str], list[int]]
    bos: int | None = None

    def __len__(self) -> int:
        return len(self.pieces)


@cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: character -> the byte it stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def piece_of(token: str, kind: str) -> bytes | None:
    """The bytes a (non-special) token string stands for under a tokenizer kind ('byte-level'
    or 'sentencepiece'); None when a byte-level token holds a character outside the alphabet."""
    if kind == "byte-level":
        table = _byte_level_decoder()
        if not all(ch in table for ch in token):
            return None
        return bytes(table[ch] for ch in token)
    byte = _BYTE_TOKEN.fullmatch(token)
    if byte:
        return bytes([int(byte.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def _pieces(vocab: dict[str, int], special: set[str], plain: set[str], kind: str, size: int) -> tuple:
    """pieces [size] from token -> id: special and plain added tokens are their own text."""
    pieces: list[bytes | None] = [None] * size
    for token, i in vocab.items():
        if i < size:
            pieces[i] = token.encode("utf-8") if token in special or token in plain else piece_of(token, kind)
    return tuple(pieces), frozenset(vocab[t] for t in special if vocab.get(t, size) < size)


def prompt_bos(tokenizer) -> int | None:
    """The id a tokenizer puts before a prompt (`encode(text)` with special tokens: a GGUF's
    `add_bos_token`, a tokenizer.json's post-processor), or None where it adds none."""
    try:
        plain, full = tokenizer.encode("a", add_special_tokens=False).ids, tokenizer.encode("a").ids
    except TypeError:  # an encode that adds nothing and takes no such argument
        return None
    return full[0] if len(full) > len(plain) and list(full[len(full) - len(plain) :]) == list(plain) else None


def text_of_hf(tokenizer, size: int | None = None) -> TokenText:
    """TokenText of a `tokenizers.Tokenizer` (ids up to `size`, default its vocabulary)."""
    spec = json.loads(tokenizer.to_str())
    kinds = json.dumps([spec.get("decoder"), spec.get("pre_tokenizer")])
    kind = "byte-level" if "ByteLevel" in kinds else "sentencepiece"
    added = tokenizer.get_added_tokens_decoder().values()
    special = {a.content for a in added if a.special}
    plain = {a.content for a in added if not a.special}
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    size = max(vocab.values(), default=-1) + 1 if size is None else size
    pieces, special_ids = _pieces(vocab, special, plain, kind, size)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    return TokenText(pieces, special_ids, encode, prompt_bos(tokenizer))


def text_of_gguf(path: str | Path, tokenizer, size: int) -> TokenText:
    """TokenText of a GGUF file's vocabulary (ids up to `size`), encoding with `tokenizer`
    (llamacpp.GGUFTokenizer or anything with `encode(text).ids`)."""
    from gguf import GGUFReader

    from .gguf_convert import gguf_vocab

    vocab, special = gguf_vocab(path)
    model = GGUFReader(str(path)).fields.get("tokenizer.ggml.model")
    kind = "sentencepiece" if model is not None and model.contents() == "llama" else "byte-level"
    pieces, special_ids = _pieces(vocab, special, set(), kind, size)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    return TokenText(pieces, special_ids, encode, prompt_bos(tokenizer))


def token_text_of(path: str | Path, model=None) -> TokenText | None:
    """TokenText of a model directory (its tokenizer.json) or a GGUF file (its own vocabulary,
    encoded by llama.cpp's tokenizer for `model`, a loaded LlamaCppModel of that file, or through
    tokenizer.json when converted from a directory); None without a vocabulary."""
    from .backend import is_gguf
    from .checkpoint import load_tokenizer

    size = getattr(model, "vocab_size", None)
    if is_gguf(path):
        from ..llamacpp import GGUFTokenizer

        if model is None or not hasattr(model, "vocab"):
            return None
        return text_of_gguf(path, GGUFTokenizer(model), size)
    tokenizer = load_tokenizer(path)
    return None if tokenizer is None else text_of_hf(tokenizer, size)
