"""Training the built-in pair: corpus, tokenizer, target pretraining, draft distillation.

Owns: the corpus (the Python standard library of the running interpreter, split by file
into train and held-out by a hash of the path), the byte-level BPE tokenizer, tokenised
data files, and two training loops (next-token cross-entropy for the target; for the draft,
the KL divergence from the target's next-token distribution to the draft's, which is what
raises acceptance: alpha = 1 - TV(p, q)). Seeded, resumable from `checkpoint.pt`, with a
progress bar. Knows nothing of speculation.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .models.checkpoint import load_pretrained, save_pretrained
from .models.llama import LlamaConfig, LlamaForCausalLM, init_weights
from .models.presets import PRESETS  # noqa: F401  (the architectures train() is given)
from .teacher import distill_loss

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
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
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
        raise ValueError(f"root {root}: need .py files in both splits, found {len(train_files)} train / {len(held_files)} held-out")
    tokenizer = train_tokenizer(train_files, vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": None, "model_max_length": 4096}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1) + "\n")
    for name, files in (("train", train_files), ("heldout", held_files)):
        tokenize_files(tokenizer, files).tofile(out / f"{name}.bin")
    split = {
        "root": str(root), "python": sys.version.split()[0], "held_out_percent": HELD_OUT_PERCENT,
        "train_files": len(train_files), "heldout_files": [p.relative_to(root).as_posix() for p in held_files],
    }
    (out / "split.json").write_text(json.dumps(split, indent=1) + "\n")
    return out


def tokenizer_vocab_size(data: str | Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(data) / "tokenizer.json")).get_vocab_size()


def load_tokens(data: str | Path, split: str) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(Path(data) / f"{split}.bin", dtype=np.uint16).astype(np.int64))


# ----------------------------------------------------------------------------- training


@dataclass
class TrainConfig:
    out: str
    data: str
    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    dtype: str = "float32"  # autocast dtype: bfloat16 on CUDA or a CPU with fast bf16 (AMX); float32 on AVX2-only CPUs
    checkpoint_every: int = 100
    teacher: str | None = None  # a target directory: distil the draft from it (KL), else plain next-token CE
    teacher_cache: str | None = None  # a cache of `verispec train teacher`: distil from it (no target pass per step)
    distill_temperature: float = 1.0
    eval_every: int = 0  # > 0: held-out loss every this many steps; the exported model is the best one seen
    max_seconds: float = 0.0  # > 0: fit the schedule (steps) to this wall time after 60 steps; stop there at the latest
    stop_after: float = 0.0  # > 0: checkpoint and stop after this wall time, the schedule unchanged (resume to go on)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "max_seconds", "stop_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = off), got {getattr(self, name)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")


def learning_rate(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_at(tokens: torch.Tensor, step: int, cfg: TrainConfig) -> torch.Tensor:
    """The step's batch [B, seq_len + 1] of random windows; a function of (seed, step) alone."""
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - cfg.seq_len - 1, (cfg.batch_size,), generator=generator)
    return torch.stack([tokens[s : s + cfg.seq_len + 1] for s in starts.tolist()])


def loss_on(model: LlamaForCausalLM, batch: torch.Tensor, teacher: LlamaForCausalLM | None, temperature: float) -> torch.Tensor:
    inputs, labels = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    if teacher is None:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    with torch.no_grad():
        teacher_logp = F.log_softmax(teacher(inputs) / temperature, dim=-1)
    logq = F.log_softmax(logits / temperature, dim=-1)
    return F.kl_div(logq, teacher_logp, log_target=True, reduction="batchmean") / inputs.shape[1]


def train(model_config: LlamaConfig, cfg: TrainConfig, progress: bool = True) -> Path:
    """Train (or resume) into cfg.out; save a Hugging Face directory at the end. Returns cfg.out."""
    from tqdm import tqdm

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model_config = model_config.replace(vocab_size=tokenizer_vocab_size(cfg.data))
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = init_weights(LlamaForCausalLM(model_config), seed=cfg.seed).to(device)
    teacher = load_pretrained(cfg.teacher, device=device).eval() if cfg.teacher else None
    cache = None
    if cfg.teacher_cache:
        from .teacher import TeacherCache

        cache = TeacherCache(cfg.teacher_cache, cfg.data)
    reference = held_out_reference(teacher, cfg.data) if teacher is not None and cfg.eval_every else None
    if cache is not None:
        teacher = None  # its passes are in the cache; it served the held-out reference only
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95)
    )
    step, log, best = 0, [], {"step": None, "heldout_loss": math.inf, "heldout_beta": -math.inf}
    checkpoint, best_path = out / "checkpoint.pt", out / "best.pt"
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, log, best = state["step"], state["log"], state.get("best", best)
    tokens = load_tokens(cfg.data, "train")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")
    bar = tqdm(total=cfg.steps, initial=step, disable=not progress, dynamic_ncols=True)
    model.train()
    tokens_per_step = cfg.batch_size * cfg.seq_len
    run_started, first_step, stopped = time.perf_counter(), step, False

    def save_checkpoint() -> None:
        _atomic_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "log": log, "best": best, "train_config": asdict(cfg)}, checkpoint)

    while step < cfg.steps:
        if cfg.max_seconds and step == first_step + 60:  # fit the cosine schedule into the time left
            steps = _steps_within(cfg.max_seconds, step, time.perf_counter() - run_started, timed_from)
            cfg = replace(cfg, steps=min(cfg.steps, steps))
        if cfg.max_seconds and time.perf_counter() - run_started > cfg.max_seconds:
            print(f"stopping at step {step}: --max-seconds {cfg.max_seconds:g} reached", flush=True)
            save_checkpoint()
            break
        if cfg.stop_after and time.perf_counter() - run_started > cfg.stop_after:
            print(f"stopping at step {step} of {cfg.steps}: --stop-after {cfg.stop_after:g} reached; run it again to go on", flush=True)
            save_checkpoint()
            stopped = True
            break
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        with autocast:
            if cache is not None:
                inputs, ids, logp, rest = (t.to(device) for t in cache.batch(step, cfg.batch_size, cfg.seed, cfg.seq_len))
                loss = distill_loss(model(inputs), ids, logp, rest)
            else:
                loss = loss_on(model, batch_at(tokens, step, cfg).to(device), teacher, cfg.distill_temperature)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        step += 1
        elapsed = time.perf_counter() - started
        if step == first_step + 10:
            timed_from = (step, time.perf_counter() - run_started)  # past the first steps' warm-up
        log.append({"step": step, "loss": loss.item(), "seconds": elapsed})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_per_step / elapsed:.0f}")
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            model.eval()
            with autocast:
                heldout = held_out_loss(model, cfg.data)
                beta = held_out_acceptance(model, reference) if reference is not None else None
            model.train()
            log[-1]["heldout_loss"] = heldout
            line = f"step {step} loss {loss.item():.4f} heldout {heldout:.4f}"
            if beta is not None:  # a draft with its target: the best is the one its target accepts most
                log[-1].update(beta_greedy=beta[0], beta_t1=beta[1])
                line += f" beta T=0 {beta[0]:.4f} T=1 {beta[1]:.4f}"
            print(f"{line} tok/s {tokens_per_step / elapsed:.0f}", flush=True)
            better = (beta[0] + beta[1]) / 2 > best.get("heldout_beta", -math.inf) if beta is not None else heldout < best["heldout_loss"]
            if better:
                best = {"step": step, "heldout_loss": heldout, **({"heldout_beta": (beta[0] + beta[1]) / 2} if beta is not None else {})}
                _atomic_save({"model": model.state_dict(), **best}, best_path)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            save_checkpoint()
    bar.close()
    if best["step"] is not None:  # early stopping: export the held-out best (acceptance with a teacher, else loss)
        model.load_state_dict(torch.load(best_path, weights_only=False, map_location=device)["model"])
    model.eval().cpu()
    save_pretrained(model, out / "model", max_shard_bytes=50_000_000, tokenizer_from=cfg.data)
    (out / "train_log.json").write_text(json.dumps({"train_config": asdict(cfg), "steps_run": step, "stopped_before_the_end": stopped, "best": best, "log": log}) + "\n")
    return out


def _steps_within(seconds: float, step: int, elapsed: float, timed_from: tuple[int, float]) -> int:
    """The last step a run can reach in `seconds`, from the pace since `timed_from` (with 10% to spare
    for held-out evaluations and checkpoints)."""
    pace = (elapsed - timed_from[1]) / (step - timed_from[0])  # seconds per step
    steps = step + int(0.9 * (seconds - elapsed) / pace)
    print(f"--max-seconds {seconds:g}: {pace * 1000:.0f} ms/step, schedule set to {steps} steps", flush=True)
    return max(step, steps)


def _atomic_save(state: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a kill mid-save loses no work


def export_checkpoint(model_config: LlamaConfig, out: str | Path, data: str | Path) -> Path:
    """Write out/model (a Hugging Face directory) from out/checkpoint.pt: a run's weights so far,
    usable while it trains or after it was stopped. Returns the model directory."""
    checkpoint = Path(out) / "checkpoint.pt"
    if not checkpoint.is_file():
        raise ValueError(f"{checkpoint}: no checkpoint to export")
    state = torch.load(checkpoint, weights_only=False, map_location="cpu")
    model = LlamaForCausalLM(model_config.replace(vocab_size=tokenizer_vocab_size(data)))
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as error:
        raise ValueError(f"{checkpoint}: does not fit this architecture ({str(error).splitlines()[0]})") from None
    save_pretrained(model.eval(), Path(out) / "model", max_shard_bytes=50_000_000, tokenizer_from=data)
    return Path(out) / "model"


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, data: str | Path, seq_len: int = 256, max_windows: int = 256) -> float:
    """Mean next-token cross-entropy (nats/token) on non-overlapping held-out windows."""
    tokens = load_tokens(data, "heldout")
    windows = min(max_windows, (len(tokens) - 1) // seq_len)
    total = 0.0
    for start in range(0, windows, 16):
        rows = range(start, min(start + 16, windows))
        batch = torch.stack([tokens[r * seq_len : r * seq_len + seq_len + 1] for r in rows])
        batch = batch.to(model.device)
        logits = model(batch[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum").item()
    return total / (windows * seq_len)


@torch.no_grad()
def held_out_reference(target: LlamaForCausalLM, data: str | Path, seq_len: int = 256, windows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distributions on held-out windows, computed once for `held_out_acceptance`:
    (inputs [W, seq_len], p [W, seq_len, V] float16 at temperature 1)."""
    tokens = load_tokens(data, "heldout")
    windows = min(windows, (len(tokens) - 1) // seq_len)
    inputs = torch.stack([tokens[w * seq_len : w * seq_len + seq_len] for w in range(windows)])
    device = next(target.parameters()).device
    probs = torch.cat([torch.softmax(target(inputs[i : i + 4].to(device)).float(), dim=-1).half().cpu() for i in range(0, windows, 4)])
    return inputs, probs


@torch.no_grad()
def held_out_acceptance(draft: LlamaForCausalLM, reference: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """beta = sum min(p, q) averaged over held-out positions, the target's p against the draft's q,
    teacher-forced on the held-out text: (at T = 0, where it is 1 when the argmaxes agree; at T = 1)."""
    inputs, probs = reference
    device = next(draft.parameters()).device
    greedy = sampled = 0.0
    for i in range(0, len(inputs), 4):
        q = torch.softmax(draft(inputs[i : i + 4].to(device)).float(), dim=-1)  # [b, T, V]
        p = probs[i : i + 4].to(device).float()
        greedy += (q.argmax(-1) == p.argmax(-1)).float().sum().item()
        sampled += torch.minimum(p, q).sum(-1).sum().item()
    return greedy / inputs.numel(), sampled / inputs.numel()
