"""llama.cpp's own server, `llama-server`, as a peer in `verispec bench-serve --peer llama-server`.

Owns the program's name, its command line (the same target GGUF, plain or with the same draft
GGUF at one `--spec-draft-n-max`; as many slots as the level's concurrency, each with the
context a verispec server gives a request; verispec's threads; prompt caching off, as verispec
has none), the request fields under which it samples the distribution verispec samples (at
T > 0 every filter off and no repeat penalty), and `LlamaServerMode`: one mode of the benchmark,
a server started for each of its rounds and stopped after it, so that two servers never decode
at once. Knows nothing of verispec's engine; the load generator (loadgen.py) loads it like any
server and reads its acceptance from the `timings` of each stream's last chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..analysis.llamacpp_program import parse_lengths
from ..llamacpp.lib import extra_buffers_fault
from ..models.gguf_header import metadata

PROGRAM = "llama-server"
NAME = "llama-server"  # the prefix of its modes' names in the report
# its sampler, under which a request samples softmax(logits / T) as verispec does: top-k, top-p
# and min-p off, no repeat penalty (its other samplers are off by default)
UNFILTERED = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}


def program(directory: str | Path) -> Path:
    """llama-server in `directory`, or ValueError naming what is missing."""
    path = Path(directory) / PROGRAM
    if not path.is_file():
        raise ValueError(
            f"--llama-cpp-bin {directory}: no {PROGRAM} there (benchmarks/build_llama_speculative.sh builds it)"
        )
    return path


def parse_draft_lengths(text: str) -> list[int]:
    """--peer-draft-n: comma-separated --spec-draft-n-max values, integers >= 1, in the order given."""
    return parse_lengths(text, "--peer-draft-n")


def command(
    target: Path, slots: int, threads: int, context: int, draft: Path | None = None, draft_n: int | None = None
) -> list[str]:
    """The server's flags but --host and --port: `slots` parallel slots of `context` positions
    each (-c is the total), `threads` for the target and the draft, prompt caching off; with
    `draft`, llama.cpp's draft-model decoding at --spec-draft-n-max `draft_n`. Everything else
    at llama.cpp's defaults."""
    if (draft is None) != (draft_n is None):
        raise ValueError("a draft model needs its draft length, and a draft length its draft model")
    flags = ["-m", str(target), "-np", str(slots), "-c", str(slots * context), "-t", str(threads)]
    flags += ["--no-cache-prompt", "--no-webui"]
    flags += ["--no-repack"] if extra_buffers_fault() else []  # as llama-cpp-python runs here (llamacpp/lib.py)
    if draft is not None:
        flags += ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_n)]
    return flags


def request_fields(temperature: float) -> dict:
    """What a request to llama-server carries beyond verispec's: at T > 0, its filters off."""
    return dict(UNFILTERED) if temperature > 0 else {}


def model_context(path: Path) -> int:
    """A GGUF's training context (`<arch>.context_length`), as verispec's server takes for a
    request's context when --max-model-len is not given."""
    arch = metadata(path, ("general.architecture",))["general.architecture"]
    return int(metadata(path, (f"{arch}.context_length",))[f"{arch}.context_length"])


@dataclass
class LlamaServerMode:
    """One llama-server mode of the benchmark: `start(concurrency)` runs the server with that
    many slots and returns its URL, ready; `stop()` ends it. `body`: its extra request fields."""

    name: str
    program: Path
    target: Path
    threads: int
    context: int
    draft: Path | None = None
    draft_n: int | None = None
    body: dict = field(default_factory=dict)
    _handle: object = field(default=None, repr=False, compare=False)

    def flags(self, concurrency: int) -> list[str]:
        return command(self.target, concurrency, self.threads, self.context, self.draft, self.draft_n)

    def start(self, concurrency: int) -> str:
        from .run import Spawned

        self.stop()
        self._handle = Spawned(self.flags(concurrency), program=[str(self.program)])
        return self._handle.url

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.stop()
            self._handle = None


def modes(
    directory: str | Path,
    target: Path,
    draft: Path | None,
    draft_lengths: list[int],
    threads: int,
    context: int,
    temperature: float,
) -> dict[str, LlamaServerMode]:
    """'llama-server plain', then with a draft model 'llama-server k=N' for each N of
    draft_lengths (--spec-draft-n-max N), by name."""
    path, body = program(directory), request_fields(temperature)
    found = {f"{NAME} plain": LlamaServerMode(f"{NAME} plain", path, target, threads, context, body=body)}
    for n in draft_lengths if draft is not None else []:
        found[f"{NAME} k={n}"] = LlamaServerMode(f"{NAME} k={n}", path, target, threads, context, draft, n, body)
    return found
