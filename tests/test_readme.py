"""The README's Python blocks run as written, against the built-in pair (its printed text is checked)."""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_python_block_of_the_readme_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no Python block"
    for block in blocks:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(block, str(README), "exec"), {})
        lines = printed.getvalue().splitlines()
        assert lines and "tokens in" in lines[-1], lines  # the statistics line closes the example
        texts = ast.literal_eval(lines[0])  # the decoded continuations, one per prompt
        assert len(texts) == 2 and all(isinstance(text, str) and text for text in texts), texts
