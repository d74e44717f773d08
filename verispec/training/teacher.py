"""Teacher distributions computed once: the target's top-k next-token distributions over a
split of the training data, on disk, for distilling drafts without a target pass per step.

Owns `build_teacher_cache` (resumable: chunks of windows, each written atomically, skipped
when present), `TeacherCache` (loads one; the windows of a training step) and
`distill_loss` (KL(p || q) with p's top-k tokens kept and the rest of its mass as one more
outcome). Knows nothing of speculation.

Window i of a split is tokens[i*L : i*L + L + 1]: the target reads its first L tokens, and
position t holds its distribution over the token after tokens[i*L .. i*L + t], as
log-probabilities of its top_k tokens (float16, most likely first), their ids (uint16) and
the log of the mass left over (float32). At top_k = 32 that is 132 bytes a position: 1.1 GB
for the built-in pair's 8.3M-token training split. `teacher.json` records what the cache was
made from (target and data hashes, L, top_k); a cache made from anything else is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

MANIFEST = "teacher.json"


@dataclass(frozen=True)
class TeacherSpec:
    """What a cache holds and was made from."""

    target_sha: str  # of the target's weight files
    data_sha: str  # of the split's token file
    split: str
    seq_len: int
    top_k: int
    windows: int
    chunk_windows: int

    @property
    def chunks(self) -> int:
        return -(-self.windows // self.chunk_windows)


def _sha(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def _chunk_path(out: Path, chunk: int) -> Path:
    return out / f"chunk-{chunk:05d}.npz"


def spec_for(
    target_dir: str | Path, data: str | Path, split: str, seq_len: int, top_k: int, chunk_windows: int
) -> TeacherSpec:
    from .data import load_tokens

    weights = sorted(Path(target_dir).glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{target_dir}: no *.safetensors weights (a Hugging Face directory is needed)")
    tokens = load_tokens(data, split)
    windows = (len(tokens) - 1) // seq_len
    if windows < 1:
        raise ValueError(f"{data}: the {split} split has {len(tokens)} tokens, fewer than one window of {seq_len} + 1")
    return TeacherSpec(
        _sha(weights), _sha([Path(data) / f"{split}.bin"]), split, seq_len, top_k, windows, chunk_windows
    )


@torch.no_grad()
def teacher_top_k(
    target: torch.nn.Module, inputs: torch.Tensor, top_k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """inputs [B, L] -> (ids [B, L, K] uint16, logp [B, L, K] float16, rest_logp [B, L] float32)."""
    logp = F.log_softmax(target(inputs).float(), dim=-1)  # [B, L, V]
    top_logp, top_ids = logp.topk(top_k, dim=-1)  # [B, L, K], most likely first
    rest = logp.scatter(-1, top_ids, float("-inf")).logsumexp(dim=-1)  # [B, L] log of the mass outside the top k
    return (
        top_ids.to(torch.int32).cpu().numpy().astype(np.uint16),
        top_logp.cpu().numpy().astype(np.float16),
        rest.clamp_min(-80.0).cpu().numpy().astype(np.float32),
    )


def build_teacher_cache(
    target_dir: str | Path,
    data: str | Path,
    out: str | Path,
    split: str = "train",
    seq_len: int = 1024,
    top_k: int = 32,
    chunk_windows: int = 64,
    batch_size: int = 4,
    dtype: str = "float32",
    max_seconds: float = 0.0,
    progress: bool = True,
) -> tuple[Path, int]:
    """Compute the chunks of out that are missing; (out, chunks still missing). With
    max_seconds > 0 it stops after the chunk that crosses that time (run it again to go on)."""
    from tqdm import tqdm

    from ..models.checkpoint import load_pretrained
    from .data import load_tokens, tokenizer_vocab_size

    if top_k < 1 or seq_len < 1 or chunk_windows < 1 or batch_size < 1:
        raise ValueError(
            f"top_k, seq_len, chunk_windows and batch_size must be >= 1, got {top_k}, {seq_len}, {chunk_windows}, "
            f"{batch_size}"
        )
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    out = Path(out)
    spec = spec_for(target_dir, data, split, seq_len, top_k, chunk_windows)
    manifest = out / MANIFEST
    if manifest.exists():
        existing = json.loads(manifest.read_text())
        if existing != asdict(spec):
            changed = sorted(
                key for key in existing.keys() | asdict(spec).keys() if existing.get(key) != asdict(spec).get(key)
            )
            raise ValueError(
                f"{out}: a teacher cache made from something else (differs in {', '.join(changed)}); use another --out"
            )
    out.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps(asdict(spec), indent=1) + "\n")
    missing = [c for c in range(spec.chunks) if not _chunk_path(out, c).exists()]
    if not missing:
        return out, 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_pretrained(target_dir, device=device).eval()
    if target.config.vocab_size < tokenizer_vocab_size(data) or target.config.vocab_size > 65536:
        raise ValueError(
            f"{target_dir}: vocabulary {target.config.vocab_size} does not fit the data's tokenizer or uint16 ids"
        )
    tokens = load_tokens(data, split)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    started = time.perf_counter()
    bar = tqdm(
        total=spec.chunks, initial=spec.chunks - len(missing), disable=not progress, unit="chunk", dynamic_ncols=True
    )
    for done, chunk in enumerate(missing):
        first, last = chunk * chunk_windows, min((chunk + 1) * chunk_windows, spec.windows)
        parts = []
        for start in range(first, last, batch_size):
            rows = range(start, min(start + batch_size, last))
            inputs = torch.stack([tokens[w * seq_len : w * seq_len + seq_len] for w in rows]).to(device)  # [b, L]
            with autocast:
                parts.append(teacher_top_k(target, inputs, top_k))
        path = _chunk_path(out, chunk)
        partial = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(
            partial,
            ids=np.concatenate([p[0] for p in parts]),
            logp=np.concatenate([p[1] for p in parts]),
            rest_logp=np.concatenate([p[2] for p in parts]),
        )
        os.replace(partial, path)  # atomic: a chunk is there whole or not at all
        bar.update(1)
        if max_seconds and time.perf_counter() - started > max_seconds:
            bar.close()
            return out, len(missing) - done - 1
    bar.close()
    return out, 0


class TeacherCache:
    """A complete cache in memory: the training windows' tokens and the teacher's top-k."""

    def __init__(self, path: str | Path, data: str | Path):
        from .data import load_tokens

        path = Path(path)
        try:
            self.spec = TeacherSpec(**json.loads((path / MANIFEST).read_text()))
        except (OSError, ValueError, TypeError) as error:
            raise ValueError(f"{path}: not a teacher cache ({error})") from None
        missing = [c for c in range(self.spec.chunks) if not _chunk_path(path, c).exists()]
        if missing:
            raise ValueError(
                f"{path}: {len(missing)} of {self.spec.chunks} chunks missing (run 'verispec train teacher' again to "
                "finish it)"
            )
        if _sha([Path(data) / f"{self.spec.split}.bin"]) != self.spec.data_sha:
            raise ValueError(f"{path}: made from other data than {data}/{self.spec.split}.bin")
        chunks = [np.load(_chunk_path(path, c)) for c in range(self.spec.chunks)]
        self.ids = torch.from_numpy(np.concatenate([c["ids"] for c in chunks]).astype(np.int64))  # [W, L, K]
        self.logp = torch.from_numpy(np.concatenate([c["logp"] for c in chunks]))  # [W, L, K] float16
        self.rest_logp = torch.from_numpy(np.concatenate([c["rest_logp"] for c in chunks]))  # [W, L]
        length = self.spec.seq_len
        tokens = load_tokens(data, self.spec.split)
        self.tokens = tokens[: self.spec.windows * length + 1]

    def batch(self, step: int, batch_size: int, seed: int, seq_len: int | None = None):
        """The step's windows (a function of seed and step alone): inputs [B, T] and the teacher's
        ids [B, T, K], logp [B, T, K] float32, rest_logp [B, T], T = seq_len (a prefix of each window)."""
        length = self.spec.seq_len
        seq_len = seq_len or length
        if seq_len > length:
            raise ValueError(f"seq_len {seq_len} exceeds the cache's windows of {length}")
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        rows = torch.randint(0, self.spec.windows, (batch_size,), generator=generator)
        inputs = torch.stack([self.tokens[w * length : w * length + seq_len] for w in rows.tolist()])
        return inputs, self.ids[rows, :seq_len], self.logp[rows, :seq_len].float(), self.rest_logp[rows, :seq_len]


def distill_loss(logits: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor, rest_logp: torch.Tensor) -> torch.Tensor:
    """Mean KL(p || q) per position, p given by its top-k (ids [B, T, K], logp [B, T, K]) and the
    log of its remaining mass (rest_logp [B, T]), q = softmax(logits [B, T, V]) with the same
    tokens kept and the rest pooled: the divergence between the two coarsened distributions,
    which is zero only when q matches p on the top k and on the rest's total."""
    logq = F.log_softmax(logits.float(), dim=-1)  # [B, T, V]
    logq_top = logq.gather(-1, ids)  # [B, T, K]
    logq_rest = (
        logq.scatter(-1, ids, float("-inf")).logsumexp(dim=-1).clamp_min(-80.0)
    )  # [B, T], floored as the teacher's
    kl = (logp.exp() * (logp - logq_top)).sum(-1) + rest_logp.exp() * (rest_logp - logq_rest)
    return kl.mean()
