"""A small corpus and a small training configuration, shared by the training and teacher tests."""

import shutil
import sysconfig
from pathlib import Path

from verispec.training.data import corpus_files, prepare_data
from verispec.training.train import TrainConfig

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def small_data(root: Path, out: Path, files: int = 60, vocab_size: int = 400) -> Path:
    """The first `files` stdlib files copied under root, tokenised into out with a small BPE."""
    for path in corpus_files()[:files]:
        target = root / path.relative_to(STDLIB)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    return prepare_data(out, vocab_size=vocab_size, root=root)


def small_config(data, out, steps: int, seq_len: int = 32, **kw) -> TrainConfig:
    return TrainConfig(
        out=str(out),
        data=str(data),
        steps=steps,
        batch_size=4,
        seq_len=seq_len,
        lr=3e-3,
        warmup=5,
        checkpoint_every=5,
        **kw,
    )


def tiny_draft_config():
    from verispec.training.train import PRESETS

    return PRESETS["tiny"].replace(hidden_size=16, num_attention_heads=1, num_key_value_heads=1, head_dim=16)


def held_out_beta(target_dir, models, data) -> list[float]:
    """beta = sum min(p, q) of each model against the target, averaged over 256 held-out positions."""
    import torch

    from verispec.models.checkpoint import load_pretrained
    from verispec.training.data import load_tokens

    target = load_pretrained(target_dir)
    ids = load_tokens(data, "heldout")[:257].view(1, -1)
    with torch.no_grad():
        p = torch.softmax(target(ids), -1)
        return [torch.minimum(p, torch.softmax(m(ids), -1)).sum(-1).mean().item() for m in models]
