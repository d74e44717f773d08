"""A GGUF target as the teacher of a draft: its corpus tokenized, its distributions cached.

Owns `read_documents` (the text a draft is trained on: a .txt file, a .jsonl file of
{"text"} / {"prompt", "completion"} rows, a directory of text files, or by default the project's
corpus, the Python standard library), `tokenize_corpus` (train / held-out token files with the
target's own tokenizer, llama.cpp's) and `build_gguf_teacher` (llama.cpp runs the target over
windows of the training split and keeps its top-k next-token distributions: chunks written
atomically, skipped when present, so an interrupted run goes on where it stopped). Knows
nothing of the draft's architecture.

Window i of a split is tokens[i*L : i*L + L]: position t of chunk row r holds the teacher's
distribution after tokens[i*L .. i*L + t] as its top_k ids (int32), their log-probabilities
(float16) and the log of the mass left over (float32).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".c", ".h", ".js", ".ts", ".java", ".go", ".rs", ".html"}
HELD_OUT_PERCENT = 5
CHUNK_WINDOWS = 8  # windows per chunk file, the unit of resumption


def _held_out(name: str) -> bool:
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:4], "big") % 100 < HELD_OUT_PERCENT


def read_documents(source: str | Path | None) -> tuple[list[str], list[str]]:
    """(train, held-out) documents of `source`, split by a hash of each document's name or line
    number (5% held out; the default corpus uses the built-in pair's own split by file)."""
    if source is None:
        from .data import read_text, split_corpus

        train, held = split_corpus()
        return [read_text(p) for p in train], [read_text(p) for p in held]
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        named = [(p.relative_to(path).as_posix(), p.read_text(encoding="utf-8", errors="replace")) for p in files]
    elif path.suffix == ".jsonl":
        named = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise ValueError(f"{path}:{number + 1}: not a JSON line") from None
            text = row.get("text") if isinstance(row, dict) else None
            if text is None and isinstance(row, dict) and "prompt" in row:
                text = str(row["prompt"]) + str(row.get("completion", ""))
            if not isinstance(text, str):
                raise ValueError(f'{path}:{number + 1}: a row needs a "text" or a "prompt" string')
            named.append((f"line {number}", text))
    elif path.is_file():
        text = path.read_text(encoding="utf-8", errors="replace")
        paragraphs = [p for p in text.split("\n\n") if p.strip()]
        named = [(f"paragraph {i}", p + "\n\n") for i, p in enumerate(paragraphs)]
    else:
        raise ValueError(f"--data {source}: no such file or directory")
    train = [text for name, text in named if not _held_out(name)]
    held = [text for name, text in named if _held_out(name)]
    if not train or not held:
        raise ValueError(f"--data {source}: too little text to hold 5% out ({len(named)} documents)")
    return train, held


def tokenize_corpus(target, documents: tuple[list[str], list[str]], out: Path) -> dict[str, np.ndarray]:
    """train.npy / heldout.npy (int32) under out: each document as the target's tokenizer reads a
    prompt (its BOS where the file asks for one), then its end-of-sequence token. Reused when present."""
    from ..llamacpp import GGUFTokenizer

    paths = {split: out / f"{split}.npy" for split in ("train", "heldout")}
    if all(p.exists() for p in paths.values()):
        return {split: np.load(p) for split, p in paths.items()}
    tokenizer = GGUFTokenizer(target)
    eos = target.config.eos_token_id
    found = {}
    for split, texts in zip(("train", "heldout"), documents):
        ids: list[int] = []
        for text in texts:
            ids.extend(tokenizer.encode(text).ids)
            if eos is not None:
                ids.append(int(eos))
        found[split] = np.asarray(ids, dtype=np.int32)
        partial = out / f"{split}.{os.getpid()}.tmp.npy"
        np.save(partial, found[split])
        os.replace(partial, paths[split])
    return found


def top_k(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """logits [..., V] -> (ids [..., K] int32, logp [..., K] float16, rest_logp [...] float32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top_logp, top_ids = logp.topk(k, dim=-1)
    rest = torch.log1p(-top_logp.exp().sum(-1).clamp(max=1 - 1e-7)).clamp_min(-80.0)
    return top_ids.to(torch.int32).numpy(), top_logp.to(torch.float16).numpy(), rest.to(torch.float32).numpy()


def build_gguf_teacher(
    forward: Callable[[torch.Tensor], torch.Tensor],
    tokens: np.ndarray,
    out: Path,
    seq_len: int,
    k: int,
    chunk_windows: int = CHUNK_WINDOWS,
    until: float = float("inf"),
    say: Callable[[str], None] = print,
) -> int:
    """Cache the teacher's top-k over the windows of `tokens` under out (chunk-NNNNN.npz), chunk
    by chunk, stopping once time.monotonic() passes `until`; `forward` maps ids [B, L] to logits
    [B, L, V] (B <= 4). Returns the windows now cached."""
    out.mkdir(parents=True, exist_ok=True)
    windows = len(tokens) // seq_len
    chunks = -(-windows // chunk_windows)
    done = sum(1 for c in range(chunks) if (out / f"chunk-{c:05d}.npz").exists())
    started, last_said = time.monotonic(), 0.0
    for chunk in range(chunks):
        path = out / f"chunk-{chunk:05d}.npz"
        if path.exists():
            continue
        if time.monotonic() >= until:
            break
        rows = range(chunk * chunk_windows, min((chunk + 1) * chunk_windows, windows))
        parts = []
        for first in range(rows.start, rows.stop, 4):
            batch = np.stack([tokens[w * seq_len : (w + 1) * seq_len] for w in range(first, min(first + 4, rows.stop))])
            with torch.no_grad():
                parts.extend(top_k(logits, k) for logits in forward(torch.from_numpy(batch.astype(np.int64))))
        partial = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(
            partial,
            windows=np.asarray(list(rows), dtype=np.int64),
            ids=np.stack([p[0] for p in parts]),
            logp=np.stack([p[1] for p in parts]),
            rest_logp=np.stack([p[2] for p in parts]),
        )
        os.replace(partial, path)
        done += 1
        if time.monotonic() - last_said > 30:
            rate = (done * chunk_windows * seq_len) / max(time.monotonic() - started, 1e-9)
            say(f"teacher: {done}/{chunks} chunks ({done * chunk_windows * seq_len:,} positions, {rate:,.0f}/s so far)")
            last_said = time.monotonic()
    return sum(len(np.load(p)["windows"]) for p in sorted(out.glob("chunk-*.npz")))


def load_teacher(out: Path, tokens: np.ndarray, seq_len: int) -> dict[str, torch.Tensor]:
    """The cached chunks in memory: inputs [W, L] and the teacher's ids [W, L, K], logp, rest_logp."""
    chunks = [np.load(p) for p in sorted(out.glob("chunk-*.npz"))]
    if not chunks:
        raise ValueError(f"{out}: no teacher chunks cached yet")
    windows = np.concatenate([c["windows"] for c in chunks])
    inputs = np.stack([tokens[w * seq_len : (w + 1) * seq_len] for w in windows])
    return {
        "inputs": torch.from_numpy(inputs.astype(np.int64)),
        "ids": torch.from_numpy(np.concatenate([c["ids"] for c in chunks]).astype(np.int64)),
        "logp": torch.from_numpy(np.concatenate([c["logp"] for c in chunks])),
        "rest_logp": torch.from_numpy(np.concatenate([c["rest_logp"] for c in chunks])),
    }
