"""One row's committed text as the draft's tokenizer reads it, kept up to date incrementally.

Owns `DraftText`: the committed target ids (`history`) and the draft ids of their text (`ids`).
After each commit only a tail is re-encoded: the text after an anchor, a point where a target
token and a draft token end at the same byte at least `MARGIN` bytes before the end, so that
the encoding before it no longer changes as text is added. Target special tokens are kept as
the draft's special token of the same text (`to_draft`), or left out (they stand for no text).
Bytes that end in an incomplete UTF-8 character wait for the rest. The draft's context starts
with the draft's own BOS where its tokenizer puts one before a prompt (the target's BOS is left
out). Where the re-encoded ids do
not spell the text byte for byte (a normaliser, invalid UTF-8), the anchor moves to the end:
what follows is encoded on its own. All of it only changes what the draft conditions on, so its
acceptance, never exactness. Knows nothing of models, caches or sampling.
"""

from __future__ import annotations

from ..models.token_text import TokenText

MARGIN = 32  # bytes before the end of the text that may still be re-encoded differently


class DraftText:
    """A row's committed target ids and their text in draft ids (`ids`)."""

    def __init__(self, target: TokenText, draft: TokenText, to_draft: list[int], prompt: list[int]):
        self.target, self.draft, self.to_draft = target, draft, to_draft
        self.history: list[int] = []
        # the draft's own BOS starts its context where its tokenizer adds one; the target's BOS is not text
        self.ids: list[int] = [] if draft.bos is None else [draft.bos]
        skip = int(bool(prompt) and target.bos is not None and prompt[0] == target.bos)
        self._anchor = (skip, len(self.ids))  # (target index, draft index): ids[:d] spell history[:t] and stay
        self.held = 0  # bytes at the end of the text that `ids` do not spell yet (an incomplete character)
        self.extend(prompt)

    def extend(self, tokens: list[int]) -> None:
        """Commit target ids; re-encode the text after the anchor."""
        self.history += tokens
        start, first = self._anchor
        ids, ends, held, exact = self._encode(self.history[start:])
        self.ids, self.held = self.ids[:first] + ids, held
        if not exact:  # offsets mean nothing: start afresh after this text (unless a character waits)
            self._anchor = self._anchor if held else (len(self.history), len(self.ids))
        elif ends:
            self._advance(start, first, ends)

    def _encode(self, tokens: list[int]) -> tuple[list[int], dict[int, int], int, bool]:
        """(draft ids of these target ids' text, where each normal target token that completes a
        character ends in it (index after it -> byte offset, special tokens counting no bytes), bytes held back at the
        end, whether the ids spell the text byte for byte)."""
        pieces, special = self.target.pieces, self.target.special
        ids: list[int] = []
        ends: dict[int, int] = {}
        text, offset, exact = b"", 0, True
        for j, token in enumerate(tokens):
            if token in special:
                more, _, ok = self._encode_bytes(text, final=False)
                ids, exact, offset, text = ids + more, exact and ok, offset + len(text), b""
                if self.to_draft[token] >= 0:
                    ids.append(self.to_draft[token])
                continue
            text += pieces[token] or b""
            if not _incomplete_tail(text):  # never inside a character: the text after must decode
                ends[j + 1] = offset + len(text)
        more, held, ok = self._encode_bytes(text, final=True)
        return ids + more, {j: e for j, e in ends.items() if e <= offset + len(text) - held}, held, exact and ok

    def _encode_bytes(self, data: bytes, final: bool) -> tuple[list[int], int, bool]:
        """(draft ids of `data`, bytes held back, whether the ids spell the rest): at the end, an
        incomplete UTF-8 character waits for its other bytes."""
        held = _incomplete_tail(data) if final else 0
        data = data[: len(data) - held]
        if not data:
            return [], held, True
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return self.draft.encode(data.decode("utf-8", errors="replace")), held, False
        ids = self.draft.encode(text)
        return ids, held, b"".join(self.draft.pieces[d] or b"" for d in ids) == data

    def _advance(self, start: int, first: int, ends: dict[int, int]) -> None:
        """Move the anchor to the last point, MARGIN bytes or more before the end, where a target
        token and a draft token end at the same byte."""
        total = max(ends.values())
        draft_ends, offset = {}, 0
        for i, d in enumerate(self.ids[first:]):
            if d not in self.draft.special:
                offset += len(self.draft.pieces[d] or b"")
                draft_ends.setdefault(offset, first + i + 1)
        for j in sorted(ends, reverse=True):
            if ends[j] <= total - MARGIN and ends[j] in draft_ends:
                self._anchor = (start + j, draft_ends[ends[j]])
                return


def _incomplete_tail(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character that is not complete (0..3)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # the lead byte of the last character
            need = 2 if byte >> 5 == 6 else 3 if byte >> 4 == 14 else 4 if byte >> 3 == 30 else 1
            return back if need > back else 0
    return 0
