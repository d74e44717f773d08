"""Write the built-in draft with another tokenizer (tests/toy_models.retokenized_draft): a draft of another
vocabulary for the built-in target, made here without downloads, for BENCHMARKS.md's cross-tokenizer figures.

    python benchmarks/retokenized_draft.py runs/retokenized-draft
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from toy_models import retokenized_draft  # noqa: E402

from verispec.pair import DRAFT_DIR, HELDOUT_PROMPTS  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/retokenized_draft.py OUT_DIR")
    retokenized_draft(DRAFT_DIR, Path(sys.argv[1]), text=HELDOUT_PROMPTS.read_text()[:20000])
    print(f"wrote {sys.argv[1]}")
