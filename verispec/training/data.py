"""The built-in pair's data: corpus, tokenizer and tokenised files.

Owns the corpus (the Python standard library of the running interpreter, split by file into
train and held-out by a hash of the path), the byte-level BPE tokenizer and the uint16 token
files `train.bin` / `heldout.bin`. Knows nothing of models or speculation.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

EOS = "<|endoftext|>"
HELD_OUT_PERCENT = 5


# ----------------------------------------------------------------------------- corpus


def corpus_files(root: str | Path | None = None) -> list[Path]:
    """Every .py file of the standard library (site-packages excluded), sorted by path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def is_held_out(path: Path, root: Path) -> bool:
    """A deterministic split by file: the hash of the relative path picks ~5% for held-out."""
    digest = hashlib.sha1(path.relative_to(root).as_posix().encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def split_corpus(root: str | Path | None = None) -> tuple[list[Path], list[Path]]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = corpus_files(root)
    held = [p for p in files if is_held_out(p, root)]
    return [p for p in files if not is_held_out(p, root)], held


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(files: list[Path], vocab_size: int = 8192):
    """A byte-level BPE trained on `files`; <|endoftext|> is token 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((read_text(p) for p in files), trainer=trainer)
    return tokenizer


def tokenize_files(tokenizer, files: list[Path]) -> np.ndarray:
    """All files encoded and joined, each followed by <|endoftext|>; uint16 token ids."""
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch([read_text(p) for p in files]):
        ids.extend(encoding.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def prepare_data(out: str | Path, vocab_size: int = 8192, root: str | Path | None = None) -> Path:
    """Write out/tokenizer.json (+ tokenizer_config.json), out/{train,heldout}.bin, out/split.json.

    Idempotent: an existing complete directory is left as it is. `root` defaults to the
    standard library of the running interpreter.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if all((out / name).exists() for name in ("tokenizer.json", "train.bin", "heldout.bin", "split.json")):
        return out
    root = Path(root or sysconfig.get_paths()["stdlib"])
    train_files, held_files = split_corpus(root)
    if not train_files or not held_files:
        raise ValueError(
            f"root {root}: need .py files in both splits, found {len(train_files)} train / {len(held_files)} held-out"
        )
    tokenizer = train_tokenizer(train_files, vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "bos_token": None,
        "model_max_length": 4096,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1) + "\n")
    for name, files in (("train", train_files), ("heldout", held_files)):
        tokenize_files(tokenizer, files).tofile(out / f"{name}.bin")
    split = {
        "root": str(root),
        "python": sys.version.split()[0],
        "held_out_percent": HELD_OUT_PERCENT,
        "train_files": len(train_files),
        "heldout_files": [p.relative_to(root).as_posix() for p in held_files],
    }
    (out / "split.json").write_text(json.dumps(split, indent=1) + "\n")
    return out


def tokenizer_vocab_size(data: str | Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(data) / "tokenizer.json")).get_vocab_size()


def load_tokens(data: str | Path, split: str) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(Path(data) / f"{split}.bin", dtype=np.uint16).astype(np.int64))
