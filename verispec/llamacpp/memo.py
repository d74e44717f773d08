"""Measurements made once per file and machine, remembered in verispec's cache directory.

Owns `remembered(kind, parts, compute)`: `compute()`'s JSON-able dict, read back from
`<cache>/<kind>/<hash>.json` when the same parts (a file's path, size and time, settings) were
measured before under the same llama.cpp build and CPU; processes asking together (replicas
starting at once) wait on a lock and compute once. The start-up deviation (deviation.py) and the
attention regime (regime.py) are kept here; a result with `"remember": False` is returned but not
kept. Knows nothing of what is measured.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable

from ..paths import cache_home, notice
from .lib import cpu_name, system_info


def remembered(kind: str, parts: list, compute: Callable[[], dict], what: str = "") -> dict:
    """`compute()`, or what it gave before for the same parts; `what` (a phrase) is said before computing."""
    key = hashlib.sha256(json.dumps([*parts, system_info(), cpu_name()]).encode()).hexdigest()[:20]
    memo = cache_home() / kind / f"{key}.json"
    memo.parent.mkdir(parents=True, exist_ok=True)
    with open(memo.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return json.loads(memo.read_text())
        except (OSError, ValueError):
            pass
        notice(f"measuring {what or kind} (once for this file and CPU, then remembered)")
        found = compute()
        if found.get("remember", True) is False:  # the measurement asks not to be kept
            return found
        temp = memo.with_suffix(f".{os.getpid()}.tmp")
        temp.write_text(json.dumps(found))
        os.replace(temp, memo)
        return found
