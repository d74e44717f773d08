"""Do a target and a draft speak the same token ids? Checks, and the one allowed difference.

Owns: `vocabularies_differ` (whether a draft needs token-level intersection),
`check_same_tokenizer` (compare two models' vocabularies, each a directory's `tokenizer.json`
or a GGUF file's own vocabulary, in any combination: the token -> id map, added tokens
included, and which tokens are special) and `match_vocab_size` (a draft whose output layer is
only padded to a different size gets logits cut or padded to the target's size). The engine
compares token ids only, so what matters is that every real token has the same id on both
sides; normalisers and pre-tokenizers never see a draft. Knows nothing of
sampling or speculation.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .checkpoint import load_tokenizer


def _tokens(directory: str | Path) -> tuple[dict[str, int], set[str]] | None:
    """(token -> id, special tokens) from directory/tokenizer.json or a GGUF file's vocabulary
    (byte-level BPE tokens are stored as the same strings in both); None without one."""
    from .backend import is_gguf

    if is_gguf(directory):
        from .gguf_convert import gguf_vocab

        vocab, special = gguf_vocab(directory)
        return (vocab, special) if vocab else None
    tokenizer = load_tokenizer(directory)  # CheckpointError (a ValueError) when unreadable
    if tokenizer is None:
        return None
    special = {added.content for added in tokenizer.get_added_tokens_decoder().values() if added.special}
    return tokenizer.get_vocab(with_added_tokens=True), special


def vocabularies_differ(target_dir: str | Path, draft_dir: str | Path) -> bool:
    """Whether both sides have a vocabulary (tokenizer.json or a GGUF's own) and they differ in
    any token's id or in which tokens are special: such a draft drafts by token-level
    intersection (drafters/cross_vocab.py) instead of sharing the target's ids."""
    target, draft = _tokens(target_dir), _tokens(draft_dir)
    return target is not None and draft is not None and target != draft


def check_same_tokenizer(
    target_dir: str | Path, draft_dir: str | Path, target_vocab_size: int, draft_vocab_size: int
) -> str:
    """Raise ValueError (one line, the FIRST difference) unless target and draft share a tokenizer.

    Each side is a model directory or a GGUF file. With a vocabulary on both sides: every token has the same
    id on both sides (target ids in increasing order first, then tokens only the draft has), the same tokens are
    special,
    and each model's output layer (`*_vocab_size`, padding included) covers its tokenizer's
    ids. The two models' vocab sizes may then differ (an embedding matrix padded to a multiple
    of 64, say): see `match_vocab_size`.
    Without `tokenizer.json` on either side the vocabularies cannot be compared, and only the
    two vocab sizes are: they must be equal.
    Returns one line saying what was checked.
    """
    target, draft = _tokens(target_dir), _tokens(draft_dir)
    if target is None or draft is None:
        missing = target_dir if target is None else draft_dir
        if target_vocab_size != draft_vocab_size:
            raise ValueError(
                f"draft vocab size {draft_vocab_size} differs from the target's {target_vocab_size} (no tokenizer.json "
                f"in {missing} to compare)"
            )
        return f"no tokenizer.json in {missing}: compared vocab sizes only ({target_vocab_size})"
    (target_ids, target_special), (draft_ids, draft_special) = target, draft
    for token, target_id in sorted(target_ids.items(), key=lambda item: item[1]):
        draft_id = draft_ids.get(token)
        if draft_id is None:
            raise ValueError(
                f"draft tokenizer differs from the target's: token {token!r} is id {target_id} in the target, absent "
                "from the draft"
            )
        if draft_id != target_id:
            raise ValueError(
                f"draft tokenizer differs from the target's: token {token!r} is id {target_id} in the target, id "
                f"{draft_id} in the draft"
            )
    for token, draft_id in sorted(draft_ids.items(), key=lambda item: item[1]):
        if token not in target_ids:
            raise ValueError(
                f"draft tokenizer differs from the target's: token {token!r} is id {draft_id} in the draft, absent "
                "from the target"
            )
    for token in sorted(target_special ^ draft_special, key=target_ids.__getitem__):
        side, other = ("target", "draft") if token in target_special else ("draft", "target")
        raise ValueError(
            f"draft tokenizer differs from the target's: token {token!r} (id {target_ids[token]}) is special in the "
            f"{side}, not in the {other}"
        )
    needed = max(target_ids.values(), default=-1) + 1
    for name, size in (("target", target_vocab_size), ("draft", draft_vocab_size)):
        if size < needed:
            raise ValueError(
                f"the {name} model has {size} output logits, fewer than its tokenizer's {needed} token ids"
            )
    sizes = f"{target_vocab_size} (target), {draft_vocab_size} (draft)"
    return f"same tokenizer ({len(target_ids)} tokens); model vocab sizes {sizes}"


class _VocabResized(nn.Module):
    """A model whose logits are cut to, or padded with -inf up to, vocab_size; all else delegated.

    Input ids beyond the model's own vocabulary (padding ids of a larger target, which an
    untrained padding row can still make the target sample) are fed as id 0: they name no token,
    and what the draft conditions on changes its acceptance rate, never exactness.
    """

    def __init__(self, model: nn.Module, vocab_size: int):
        super().__init__()
        self.model = model
        self.vocab_size = vocab_size

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def new_cache(self, batch_size: int, max_length: int):
        return self.model.new_cache(batch_size, max_length)

    def prefill(self, prompts: list[list[int]], cache) -> None:
        known = self.model.vocab_size
        self.model.prefill([[t if t < known else 0 for t in prompt] for prompt in prompts], cache)

    def forward(self, input_ids: torch.Tensor, cache=None) -> torch.Tensor:
        input_ids = input_ids.masked_fill(input_ids >= self.model.vocab_size, 0)  # [B, T]
        logits = self.model(input_ids, cache)  # [B, T, V_model]
        extra = self.vocab_size - logits.shape[-1]
        if extra <= 0:
            return logits[..., : self.vocab_size]
        return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))


def match_vocab_size(model: nn.Module, vocab_size: int) -> nn.Module:
    """`model` itself when its vocab size is vocab_size; else a view whose logits have vocab_size entries.

    For a draft whose output layer is padded differently from the target's (after
    `check_same_tokenizer`): padding ids beyond the draft's are given probability 0, and the
    draft's own padding beyond the target's is dropped. Exactness is unaffected: the draft
    declares the distribution it samples from, whatever that is.
    """
    return model if model.vocab_size == vocab_size else _VocabResized(model, vocab_size)
