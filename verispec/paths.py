"""Where verispec keeps what it builds and measures (compiled kernels, converted GGUF files, per-file
measurements): one root, `VERISPEC_CACHE`, by default `$XDG_CACHE_HOME/verispec`, else `~/.cache/verispec`; and
`notice`, the one line a first run's wait (building, converting, measuring into these caches) prints."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def notice(line: str) -> None:
    """A wait the user should hear of (a build, a conversion, a measurement made once): `verispec: LINE` on stderr."""
    print(f"verispec: {line}", file=sys.stderr, flush=True)


def cache_home() -> Path:
    """The root of every cache of verispec's, read from the environment at each call."""
    if os.environ.get("VERISPEC_CACHE"):
        return Path(os.environ["VERISPEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "verispec"
