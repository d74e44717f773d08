"""`verispec train draft --target MODEL.gguf`: a draft distilled from a user's GGUF on the CPU.

Owns `DraftRun` (what a run is made of), `train_gguf_draft` (the stages, each resumable, inside one
time budget) and the training loop. A run directory holds:

    run.json            the run's settings and the seconds spent so far (a resumed run must match them)
    corpus/             train.npy, heldout.npy: the data in the target's own token ids
    teacher/            the teacher's top-k distributions over training windows (gguf_teacher.py)
    heldout-teacher.npz llama.cpp's own top-k on held-out windows: what acceptance is measured against
    subset.json         the draft's output vocabulary (draft_head.choose_subset) and what it costs
    checkpoint.pt       the draft, its optimizer and its clock (every minute and at the end)
    draft.gguf          the result (draft_export.py), and MODEL_CARD.md beside it

The draft: the target's hidden size, its first `layers` layers as the starting point, its input
embedding (frozen) and an output head over the subset, initialised from the target's output rows.
The budget (--minutes) covers everything: the teacher stops at `teacher_share` of it (or at the
end of the data), training at the end less a reserve for the export. The teacher runs on whichever of
llama.cpp and the dequantized PyTorch copy (float32 or bfloat16) measures fastest on one window;
acceptance is measured against llama.cpp's own distributions. Knows nothing of decoding.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .draft_head import SubsetHeadLlama, choose_subset, subset_distill_loss, subset_index, token_mass
from .gguf_teacher import CHUNK_WINDOWS, build_gguf_teacher, load_teacher, read_documents, tokenize_corpus, top_k
from .teacher import _sha

Say = Callable[[str], None]
EXPORT_RESERVE_S = 90.0  # at most, kept back from training for the export, the card and the last evaluation
HELDOUT_WINDOWS = 8


@dataclass(frozen=True)
class DraftRun:
    target: str
    out: str
    data: str | None = None  # None: the project's corpus (the Python standard library)
    minutes: float = 60.0
    layers: int = 2
    seq_len: int = 256
    top_k: int = 16
    batch_size: int = 8
    lr: float = 2e-3
    max_subset_cost: float = 0.01  # acceptance the vocabulary subset may cost (draft_head.choose_subset)
    teacher_share: float = 0.4
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.minutes > 0:
            raise ValueError(f"--minutes must be > 0, got {self.minutes:g}")
        for name in ("layers", "seq_len", "top_k", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.teacher_share < 1 or not 0 <= self.max_subset_cost < 1:
            raise ValueError("teacher_share must be in (0, 1) and max_subset_cost in [0, 1)")


def _write_json(path: Path, value: dict) -> None:
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(partial, path)


class _Clock:
    """Seconds spent on a run, across resumptions (kept in run.json)."""

    def __init__(self, out: Path, state: dict):
        self.out, self.state = out, state
        self.since, self.spent_before = time.monotonic(), float(state.get("seconds_spent", 0.0))

    @property
    def spent(self) -> float:
        return self.spent_before + time.monotonic() - self.since

    def save(self) -> None:
        _write_json(self.out / "run.json", {**self.state, "seconds_spent": round(self.spent, 1)})


def _open_run(run: DraftRun) -> tuple[Path, dict]:
    out = Path(run.out)
    if not Path(run.target).is_file():
        raise ValueError(f"--target {run.target}: no such GGUF file")
    from ..models.gguf_header import metadata

    arch = metadata(run.target, ("general.architecture",)).get("general.architecture")
    if arch != "llama":  # the draft starts from the target's own llama-architecture tensors (gguf_torch.py)
        raise ValueError(
            f"--target {run.target}: architecture {arch!r}; drafts are trained for llama-architecture files"
        )
    out.mkdir(parents=True, exist_ok=True)
    settings = {key: value for key, value in asdict(run).items() if key not in ("out", "minutes")}
    state = {"settings": settings, "target_sha": _sha([Path(run.target)])}
    path = out / "run.json"
    if path.exists():
        before = json.loads(path.read_text())
        changed = [k for k in ("settings", "target_sha") if before.get(k) != state[k]]
        if changed:
            raise ValueError(f"--out {out}: a run made with other {' and '.join(changed)}; use another --out")
        state = before
    return out, state


def fastest_teacher(target_path: str, target, window: torch.Tensor, say: Say):
    """(name, forward: ids [B, L] -> logits [B, L, V]) of the fastest teacher measured on `window` [4, L]."""
    from ..models.gguf_torch import load_gguf_torch

    def llamacpp(ids: torch.Tensor) -> torch.Tensor:  # [B, L] -> [B, L, V], a row at a time
        return torch.stack([target(row[None], target.new_cache(1, ids.shape[1]))[0] for row in ids])

    candidates = {"llama.cpp": llamacpp}
    try:
        copy = load_gguf_torch(target_path)
    except ValueError as error:  # not a llama-architecture file: llama.cpp alone
        say(f"teacher: llama.cpp ({str(error).splitlines()[0]})")
        return "llama.cpp", llamacpp
    for dtype in (torch.float32, torch.bfloat16):

        def forward(ids: torch.Tensor, dtype=dtype) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                return copy(ids).float()

        candidates[f"torch {str(dtype).removeprefix('torch.')}"] = forward
    times = {}
    with torch.no_grad():
        for name, forward in candidates.items():
            forward(window)  # warm
            started = time.perf_counter()
            forward(window)
            times[name] = time.perf_counter() - started
    best = min(times, key=times.get)
    say(
        "teacher: "
        + ", ".join(f"{n} {window.numel() / t:,.0f} positions/s" for n, t in times.items())
        + f": using {best}"
    )
    return best, candidates[best]


def new_draft(run: DraftRun, vocab_ids: torch.Tensor) -> SubsetHeadLlama:
    """The target's first run.layers layers, its embedding (frozen) and its output rows of the subset."""
    from ..models.gguf_torch import read_gguf_weights
    from ..models.llama import from_hf_state_dict

    config, state = read_gguf_weights(run.target, run.layers)
    draft = SubsetHeadLlama(config, vocab_ids)
    head = state.pop("lm_head.weight", state["model.embed_tokens.weight"])
    state = from_hf_state_dict(state, config.replace(tie_word_embeddings=False))
    state["lm_head.weight"] = head[vocab_ids].clone()
    state["vocab_ids"] = vocab_ids
    draft.load_state_dict(state)
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft


def heldout_acceptance(draft: SubsetHeadLlama, heldout: dict, autocast) -> tuple[float, float]:
    """Teacher-forced on held-out windows against llama.cpp's top-k: (greedy: argmaxes agree;
    T = 1: sum over the target's top-k of min(p, q), a lower bound of sum min(p, q))."""
    greedy = sampled = 0.0
    draft.eval()
    with torch.no_grad(), autocast:
        for row in range(len(heldout["inputs"])):
            q = torch.softmax(draft(heldout["inputs"][row : row + 1])[0].float(), dim=-1)  # [L, V]
            ids, p = heldout["ids"][row], heldout["logp"][row].float().exp()  # [L, K]
            greedy += (q.argmax(-1) == ids[:, 0]).float().sum().item()
            sampled += torch.minimum(p, q.gather(-1, ids)).sum().item()
    draft.train()
    positions = heldout["ids"].shape[0] * heldout["ids"].shape[1]
    return greedy / positions, sampled / positions


def _autocast(run: DraftRun, draft: SubsetHeadLlama, batch: torch.Tensor) -> torch.autocast:
    """bfloat16 autocast where a training step measures faster with it (AMX, AVX512_BF16), else off."""
    times = {}
    for enabled in (False, True):
        cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)
        for _ in range(2):
            started = time.perf_counter()
            with cast:
                loss = draft(batch).float().logsumexp(-1).mean()
            loss.backward()
            times[enabled] = time.perf_counter() - started
    draft.zero_grad(set_to_none=True)
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=times[True] < 0.8 * times[False])


def train_gguf_draft(run: DraftRun, say: Say = print) -> Path:
    """Run (or resume) every stage of `run` within its budget; returns the draft's GGUF path."""
    from ..llamacpp import LlamaCppModel
    from .draft_export import write_card, write_draft_gguf

    out, state = _open_run(run)
    clock = _Clock(out, state)
    budget = run.minutes * 60.0
    torch.manual_seed(run.seed)
    target = LlamaCppModel(run.target)
    say(
        f"corpus: {'the Python standard library' if run.data is None else run.data} in {Path(run.target).name}'s tokens"
    )
    (out / "corpus").mkdir(exist_ok=True)
    tokens = tokenize_corpus(target, read_documents(run.data), out / "corpus")
    if len(tokens["train"]) < run.seq_len or len(tokens["heldout"]) < run.seq_len:
        raise ValueError(f"--data: fewer than {run.seq_len} tokens in a split; give more text")
    heldout = _heldout_teacher(out, target, tokens["heldout"], run)
    window = torch.from_numpy(tokens["train"][: 4 * run.seq_len].astype(np.int64)).view(4, run.seq_len)
    teacher_dir = out / "teacher"
    windows_total = len(tokens["train"]) // run.seq_len
    cached = len(list(teacher_dir.glob("chunk-*.npz"))) * CHUNK_WINDOWS if teacher_dir.exists() else 0
    if cached < windows_total and clock.spent < run.teacher_share * budget:
        name, forward = fastest_teacher(run.target, target, window, say)
        state["teacher"] = name
        until = time.monotonic() + run.teacher_share * budget - clock.spent
        build_gguf_teacher(forward, tokens["train"], teacher_dir, run.seq_len, run.top_k, until=until, say=say)
        clock.save()
    data = load_teacher(teacher_dir, tokens["train"], run.seq_len)
    say(f"teacher: {data['ids'].shape[0] * run.seq_len:,} positions cached ({state.get('teacher', 'llama.cpp')})")
    vocab_ids, subset = _subset(out, data, target, run)
    draft = new_draft(run, vocab_ids)
    trained = _train(run, draft, data, heldout, vocab_ids, clock, budget, out, say)
    state.update(subset=subset, training=trained)
    clock.save()
    path = write_draft_gguf(draft, run.target, out / "draft.gguf")
    write_card(out, run, state, clock.spent)
    clock.save()
    return path


def _heldout_teacher(out: Path, target, tokens: np.ndarray, run: DraftRun) -> dict:
    path = out / "heldout-teacher.npz"
    if not path.exists():
        windows = min(HELDOUT_WINDOWS, len(tokens) // run.seq_len)
        inputs = torch.from_numpy(tokens[: windows * run.seq_len].astype(np.int64)).view(windows, run.seq_len)
        parts = []
        for row in inputs:
            cache = target.new_cache(1, run.seq_len)
            with torch.no_grad():
                parts.append(top_k(target(row[None], cache)[0], run.top_k))
            del cache
        partial = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(
            partial, inputs=inputs.numpy(), ids=np.stack([p[0] for p in parts]), logp=np.stack([p[1] for p in parts])
        )
        os.replace(partial, path)
    found = np.load(path)
    return {
        "inputs": torch.from_numpy(found["inputs"]),
        "ids": torch.from_numpy(found["ids"].astype(np.int64)),
        "logp": torch.from_numpy(found["logp"]),
    }


def _subset(out: Path, data: dict, target, run: DraftRun) -> tuple[torch.Tensor, dict]:
    path = out / "subset.json"
    if path.exists():
        found = json.loads(path.read_text())
        return torch.tensor(found["vocab_ids"], dtype=torch.long), found["report"]
    vocab = target.vocab_size
    mass = token_mass(data["ids"], data["logp"], vocab)
    argmax_counts = torch.bincount(data["ids"][..., 0].reshape(-1), minlength=vocab)
    eos = target.config.eos_token_id
    ids, report = choose_subset(mass, argmax_counts, run.max_subset_cost, always=() if eos is None else (int(eos),))
    _write_json(path, {"vocab_ids": ids.tolist(), "report": report})
    return ids, report


def _train(run, draft, data, heldout, vocab_ids, clock: _Clock, budget: float, out: Path, say: Say) -> dict:
    """AdamW with warm-up and a cosine decay over the training seconds (not steps), so that the
    schedule fits the budget; resumable from checkpoint.pt."""
    index = subset_index(vocab_ids, draft.config.vocab_size)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=run.lr, betas=(0.9, 0.95), weight_decay=0.0)
    checkpoint = out / "checkpoint.pt"
    step, train_seconds, log, best = 0, 0.0, [], None
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        if saved["vocab_ids"] != vocab_ids.tolist():
            raise ValueError(f"{checkpoint}: made with another vocabulary subset")
        draft.load_state_dict(saved["model"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])
        step, train_seconds, log, best = saved["step"], saved["train_seconds"], saved["log"], saved.get("best")
    reserve = min(EXPORT_RESERVE_S, 0.1 * budget)
    total = max(budget - reserve - (clock.spent - train_seconds), 1.0)  # seconds training may take
    windows = data["inputs"].shape[0]
    autocast = _autocast(run, draft, data["inputs"][: min(run.batch_size, windows)])
    say(
        f"draft: {run.layers} layers, head over {len(vocab_ids):,} of {draft.config.vocab_size:,} tokens; "
        f"training for {max(total - train_seconds, 0) / 60:.1f} min "
        f"(bfloat16 autocast {'on' if autocast._enabled else 'off'})"
    )

    def save() -> None:
        partial = checkpoint.with_suffix(f".{os.getpid()}.tmp")
        torch.save(
            {
                "model": _trained_state(draft),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "train_seconds": train_seconds,
                "log": log,
                "best": best,
                "vocab_ids": vocab_ids.tolist(),
            },
            partial,
        )
        os.replace(partial, checkpoint)
        clock.save()

    last_saved = last_eval = time.monotonic()
    draft.train()
    try:  # an interrupt keeps the steps made since the last checkpoint
        while train_seconds < total:
            started = time.monotonic()
            progress = train_seconds / total
            lr = run.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
            for group in optimizer.param_groups:
                group["lr"] = lr
            rows = torch.randint(
                0, windows, (run.batch_size,), generator=torch.Generator().manual_seed(run.seed * 7919 + step)
            )
            with autocast:
                hidden = draft.hidden_states(data["inputs"][rows], None)
                loss = subset_distill_loss(
                    draft.subset_logits(hidden),
                    data["ids"][rows],
                    data["logp"][rows].float(),
                    data["rest_logp"][rows],
                    index,
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            train_seconds += time.monotonic() - started
            if time.monotonic() - last_eval > 120 or train_seconds >= total:
                greedy, sampled = heldout_acceptance(draft, heldout, autocast)
                log.append(
                    {
                        "step": step,
                        "seconds": round(train_seconds),
                        "loss": loss.item(),
                        "beta_greedy": greedy,
                        "beta_t1": sampled,
                    }
                )
                say(
                    f"draft: step {step}, {train_seconds / 60:.1f}/{total / 60:.1f} min, loss {loss.item():.3f}, "
                    f"held-out acceptance greedy {greedy:.3f}, T=1 {sampled:.3f}"
                )
                if best is None or greedy + sampled > best["beta_greedy"] + best["beta_t1"]:
                    best = {**log[-1], "model": {k: v.clone() for k, v in _trained_state(draft).items()}}
                last_eval = time.monotonic()
            if time.monotonic() - last_saved > 60:
                save()
                last_saved = time.monotonic()
    except KeyboardInterrupt:
        save()
        raise
    if best is not None:
        draft.load_state_dict(best["model"], strict=False)
    save()
    chosen = {k: v for k, v in (best or {}).items() if k != "model"}
    return {"steps": step, "seconds": round(train_seconds), "chosen": chosen, "bfloat16": bool(autocast._enabled)}


def _trained_state(draft: SubsetHeadLlama) -> dict[str, torch.Tensor]:
    """The draft's weights less its frozen input embedding (the target's, read again on resumption)."""
    return {k: v for k, v in draft.state_dict().items() if k != "model.embed_tokens.weight"}
