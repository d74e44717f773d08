"""Training the built-in pair: target pretraining and draft distillation.

Owns two training loops over the tokenised files of `data.py` (next-token cross-entropy for the target; for the draft,
the KL divergence from the target's next-token distribution to the draft's, which is what
raises acceptance: alpha = 1 - TV(p, q)). Seeded, resumable from `checkpoint.pt`, with a
progress bar. Knows nothing of speculation.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.checkpoint import load_pretrained, save_pretrained
from ..models.llama import LlamaConfig, LlamaForCausalLM, init_weights
from ..models.presets import PRESETS  # noqa: F401  (the architectures train() is given)
from .data import load_tokens, tokenizer_vocab_size
from .teacher import distill_loss

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


def loss_on(
    model: LlamaForCausalLM, batch: torch.Tensor, teacher: LlamaForCausalLM | None, temperature: float
) -> torch.Tensor:
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
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
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
        _atomic_save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "log": log,
                "best": best,
                "train_config": asdict(cfg),
            },
            checkpoint,
        )

    timed_from = (first_step, 0.0)  # replaced past the first steps' warm-up, before it is read
    while step < cfg.steps:
        if cfg.max_seconds and step == first_step + 60:  # fit the cosine schedule into the time left
            steps = _steps_within(cfg.max_seconds, step, time.perf_counter() - run_started, timed_from)
            cfg = replace(cfg, steps=min(cfg.steps, steps))
        if cfg.max_seconds and time.perf_counter() - run_started > cfg.max_seconds:
            print(f"stopping at step {step}: --max-seconds {cfg.max_seconds:g} reached", flush=True)
            save_checkpoint()
            break
        if cfg.stop_after and time.perf_counter() - run_started > cfg.stop_after:
            print(
                f"stopping at step {step} of {cfg.steps}: --stop-after {cfg.stop_after:g} reached; run it again to go "
                "on",
                flush=True,
            )
            save_checkpoint()
            stopped = True
            break
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        with autocast:
            if cache is not None:
                inputs, ids, logp, rest = (
                    t.to(device) for t in cache.batch(step, cfg.batch_size, cfg.seed, cfg.seq_len)
                )
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
            better = (
                (beta[0] + beta[1]) / 2 > best.get("heldout_beta", -math.inf)
                if beta is not None
                else heldout < best["heldout_loss"]
            )
            if better:
                best = {
                    "step": step,
                    "heldout_loss": heldout,
                    **({"heldout_beta": (beta[0] + beta[1]) / 2} if beta is not None else {}),
                }
                _atomic_save({"model": model.state_dict(), **best}, best_path)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            save_checkpoint()
    bar.close()
    if best["step"] is not None:  # early stopping: export the held-out best (acceptance with a teacher, else loss)
        model.load_state_dict(torch.load(best_path, weights_only=False, map_location=device)["model"])
    model.eval().cpu()
    save_pretrained(model, out / "model", max_shard_bytes=50_000_000, tokenizer_from=cfg.data)
    (out / "train_log.json").write_text(
        json.dumps(
            {
                "train_config": asdict(cfg),
                "steps_run": step,
                "stopped_before_the_end": stopped,
                "best": best,
                "log": log,
            }
        )
        + "\n"
    )
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
def held_out_reference(
    target: LlamaForCausalLM, data: str | Path, seq_len: int = 256, windows: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distributions on held-out windows, computed once for `held_out_acceptance`:
    (inputs [W, seq_len], p [W, seq_len, V] float16 at temperature 1)."""
    tokens = load_tokens(data, "heldout")
    windows = min(windows, (len(tokens) - 1) // seq_len)
    inputs = torch.stack([tokens[w * seq_len : w * seq_len + seq_len] for w in range(windows)])
    device = next(target.parameters()).device
    probs = torch.cat(
        [torch.softmax(target(inputs[i : i + 4].to(device)).float(), dim=-1).half().cpu() for i in range(0, windows, 4)]
    )
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
