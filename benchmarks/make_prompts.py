"""Write the benchmark prompt files from the held-out split of the corpus (JSON lines, {"prompt": ...}).

- heldout.jsonl: the first lines of functions from held-out standard-library files (the model
  continues the body): the general workload of `verispec bench` and `verispec plan`.
- editing.jsonl: "rewrite this function with a different name": a held-out function, then the
  header of the same function renamed; the continuation is mostly text already in the prompt
  (the prompt-lookup workload).

Prompts end at the end of a line, without its newline: byte-level BPE joins a newline with
the next line's indentation, so a prompt that ends in "\n" would start the model on a token
split it never saw in training (it then writes at column 0).

Usage: python benchmarks/make_prompts.py [DATA_DIR] (default runs/data, from `verispec train data`).
Deterministic: the same corpus and split give the same files.
"""

from __future__ import annotations

import ast
import json
import random
import sys
from pathlib import Path


def functions(source: str) -> list[tuple[str, str]]:
    """(name, source text) of every top-level or method `def` whose text parses."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
            text = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            indent = len(text) - len(text.lstrip())
            out.append((node.name, "\n".join(line[indent:] for line in text.splitlines())))
    return out


def main(data_dir: str = "runs/data", out_dir: str = "benchmarks", count: int = 16, seed: int = 0) -> None:
    split = json.loads((Path(data_dir) / "split.json").read_text())
    root = Path(split["root"])
    candidates = []
    for name in sorted(split["heldout_files"]):
        try:
            candidates.extend(functions((root / name).read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
    rng = random.Random(seed)
    rng.shuffle(candidates)
    general, editing = [], []
    for name, text in candidates:
        lines = text.splitlines()
        if len(general) < count and 6 <= len(lines) and len(text) < 4000:
            general.append({"prompt": "\n".join(lines[:3]).rstrip("\n")})
        elif len(editing) < count and 6 <= len(lines) <= 20 and len(text) < 900 and not name.startswith("_"):
            renamed = lines[0].replace(f"def {name}(", f"def {name}_v2(", 1)
            editing.append({"prompt": f"{text}\n\n\n# The same function with a different name.\n{renamed}"})
        if len(general) == count and len(editing) == count:
            break
    for file, rows in (("heldout.jsonl", general), ("editing.jsonl", editing)):
        Path(out_dir, file).write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {Path(out_dir, file)}: {len(rows)} prompts")


if __name__ == "__main__":
    main(*sys.argv[1:2])
