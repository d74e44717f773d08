"""Which draft `verispec train draft --target` trained for which file, so that `--draft auto` finds it.

Owns `register(target, draft)` and `trained_draft(target)`: a small JSON file under the cache root
(`paths.cache_home()/trained-drafts.json`) keyed by the target's resolved path, its size and its
modification time, so that a file replaced or changed since loses its draft. Entries whose files are
gone are dropped at the next registration. Knows nothing of models' contents.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..paths import cache_home


def _registry() -> Path:
    return cache_home() / "trained-drafts.json"


def _key(target: str | Path) -> tuple[str, dict] | None:
    try:
        path = Path(target).resolve()
        stat = path.stat()
    except OSError:
        return None
    return str(path), {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _read() -> dict:
    try:
        found = json.loads(_registry().read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def register(target: str | Path, draft: str | Path) -> None:
    """Remember `draft` as the draft trained for the file `target` is now."""
    key = _key(target)
    if key is None:
        return
    entries = {
        name: entry
        for name, entry in _read().items()
        if isinstance(entry, dict) and Path(name).exists() and Path(str(entry.get("draft"))).exists()
    }
    entries[key[0]] = {**key[1], "draft": str(Path(draft).resolve())}
    path = _registry()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(entries, indent=1) + "\n")
    os.replace(partial, path)


def trained_draft(target: str | Path) -> str | None:
    """The draft trained for `target` as it is now (same size and modification time), if its file exists."""
    key = _key(target)
    if key is None:
        return None
    entry = _read().get(key[0])
    if not isinstance(entry, dict) or any(entry.get(name) != value for name, value in key[1].items()):
        return None
    draft = entry.get("draft")
    return draft if isinstance(draft, str) and Path(draft).is_file() else None
