"""The side-by-side with llama.cpp itself, on the same GGUF files (`verispec bench --peer llamacpp`).

Owns `run_llamacpp_peer_bench`. Batch 1, the same prompts, every system in every round (the
order fixed, so drift lands on all of them), medians of decode-only tokens/s:
- verispec plain and verispec speculative at draft length k (the draft model, or prompt lookup
  with `draft=None`), both on llama.cpp (`LlamaCppModel`): decode = total time - prefill;
- llama.cpp plain through llama-cpp-python (`Llama.generate`, its own sampler): decode = from
  the first generated token on;
- llama.cpp's prompt lookup through llama-cpp-python (`LlamaPromptLookupDecoding`, k tokens);
- llama.cpp's own speculative decoding, when `speculative_bin` names a directory holding
  `llama-speculative-simple` (built from the same llama.cpp version): the same target and
  draft files, `--draft-max k`, its other settings at their defaults; its decode speed and its
  acceptance are read from its log.
Every system generates max_new_tokens tokens per prompt, never stopping early (llama.cpp's own
program may go a few tokens past, by its own rule). Greedy outputs are compared with llama.cpp
plain's, as token ids (as text for the external program, which prints text).
"""

from __future__ import annotations

import re
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .config import SamplingParams
from .drafters.model import ModelDrafter
from .drafters.ngram import PromptLookupDrafter
from .engine import generate_all
from .models.llamacpp import GGUFTokenizer, LlamaCppModel
from .stats import SpecStats

SPECULATIVE_PROGRAM = "llama-speculative-simple"


def _llama_cpp_python(path: Path, n_ctx: int, threads: int, k: int, lookup: bool):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=k) if lookup else None
    return Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 draft_model=draft, verbose=False)


def _run_llama_cpp_python(llm, prompt: list[int], max_new_tokens: int, temperature: float, seed: int) -> tuple[list[int], float]:
    """(tokens, decode seconds): llama-cpp-python's generate, its prompt cache emptied first."""
    llm.reset()
    llm.set_seed(seed)
    tokens, first = [], None
    sampling = dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0) if temperature > 0 else dict(temp=0.0)
    for token in llm.generate(prompt, reset=True, **sampling):
        tokens.append(int(token))
        if first is None:
            first = time.perf_counter()
        if len(tokens) == max_new_tokens:
            break
    return tokens, time.perf_counter() - first


def _run_speculative_program(program: Path, target: Path, draft: Path, text: str, max_new_tokens: int, k: int,
                             temperature: float, seed: int, threads: int, n_ctx: int) -> dict:
    """llama.cpp's own speculative decoding of one prompt: its text, decode speed and acceptance."""
    sampling = ["--temp", "0"] if temperature == 0 else ["--temp", str(temperature), "--top-k", "0", "--top-p", "1", "--min-p", "0"]
    command = [str(program), "-m", str(target), "-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(k),
               "-p", text, "-n", str(max_new_tokens), "-t", str(threads), "-td", str(threads), "-c", str(n_ctx), "-s", str(seed), "-fa", "off", *sampling]
    done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=600)
    log = done.stderr
    speed = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    if done.returncode != 0 or speed is None:
        tail = " / ".join(log.strip().splitlines()[-3:])
        raise RuntimeError(f"{program.name} failed (exit {done.returncode}): {tail}")
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
    printed = done.stdout.removeprefix("\n\n").removesuffix("\n\n")  # it prints the prompt, then the continuation
    return {"text": printed.removeprefix(text), "tokens": int(speed.group(1)), "seconds": float(speed.group(2)),
            "drafted": int(drafted.group(1)) if drafted else 0, "accepted": int(accepted.group(1)) if accepted else 0}


def run_llamacpp_peer_bench(
    target_path: str | Path,
    draft_path: str | Path | None,
    prompts: Sequence[str],
    k: int = 4,
    max_new_tokens: int = 128,
    repeats: int = 3,
    temperature: float = 0.0,
    seed: int = 0,
    threads: int | None = None,
    speculative_bin: str | Path | None = None,
    progress: Callable[[], None] | None = None,
) -> dict:
    """Median decode tokens/s per system, ratios to llama.cpp plain, acceptance, and identity.
    Prompts are texts, encoded with the target GGUF's own vocabulary. `draft_path=None`
    compares prompt lookup (verispec's and llama-cpp-python's) instead."""
    if repeats < 1 or k < 1 or max_new_tokens < 2:
        raise ValueError(f"repeats and k must be >= 1 and max_new_tokens >= 2, got {repeats}, {k}, {max_new_tokens}")
    target_path = Path(target_path)
    target = LlamaCppModel(target_path, threads)
    threads = target.n_threads
    tokenizer = GGUFTokenizer(target)
    texts, prompts = list(prompts), [tokenizer.encode(text).ids for text in prompts]
    n_ctx = max(map(len, prompts)) + max_new_tokens + k + 16
    params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=max_new_tokens)
    stats: dict[str, SpecStats] = {}
    own: dict[str, list[float]] = {}  # per verispec system: [decode seconds, seconds inside llama.cpp's passes, target forward seconds]

    def verispec(name: str, make_drafter) -> Callable[[list[int]], tuple[list[int], float]]:
        def run(prompt: list[int]) -> tuple[list[int], float]:
            run_stats, drafter = SpecStats(), make_drafter()
            models = [target] + ([drafter.model] if isinstance(drafter, ModelDrafter) else [])
            inside_before, target_before = sum(m.forward_compute_s for m in models), target.forward_compute_s
            out = generate_all(target, [prompt], params, drafter, k=k if drafter is not None else 0, stats=run_stats)[0]
            stats.setdefault(name, SpecStats()).add(run_stats.requests[0])
            decode_s = run_stats.total_time_s - run_stats.prefill_time_s
            totals = own.setdefault(name, [0.0, 0.0, 0.0])
            totals[0] += decode_s
            totals[1] += sum(m.forward_compute_s for m in models) - inside_before
            totals[2] += target.forward_compute_s - target_before
            return out, decode_s
        return run

    plain = _llama_cpp_python(target_path, n_ctx, threads, k, lookup=False)
    systems: dict[str, Callable[[list[int]], tuple[list[int], float]]] = {
        "llama.cpp plain (llama-cpp-python)": lambda p: _run_llama_cpp_python(plain, p, max_new_tokens, temperature, seed),
        "verispec plain": verispec("verispec plain", lambda: None),
    }
    if draft_path is not None:
        draft = LlamaCppModel(draft_path, threads)
        systems[f"verispec k={k}"] = verispec(f"verispec k={k}", lambda: ModelDrafter(draft))
    else:
        lookup = _llama_cpp_python(target_path, n_ctx, threads, k, lookup=True)
        systems[f"llama.cpp prompt lookup k={k} (llama-cpp-python)"] = lambda p: _run_llama_cpp_python(lookup, p, max_new_tokens, temperature, seed)
        systems[f"verispec prompt lookup k={k}"] = verispec(f"verispec prompt lookup k={k}", PromptLookupDrafter)
    program = Path(speculative_bin) / SPECULATIVE_PROGRAM if speculative_bin else None
    if program is not None and draft_path is not None:
        if not program.is_file():
            raise ValueError(f"--llama-cpp-bin {speculative_bin}: no {SPECULATIVE_PROGRAM} there (see docs/LLAMACPP.md to build it)")
        speculative_name = f"llama.cpp speculative k={k} ({SPECULATIVE_PROGRAM})"
    speeds: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, list[list[int]]] = {}
    own_runs: list[list[dict]] = []
    for _ in range(repeats):
        for name, run in systems.items():
            results = [run(list(p)) for p in prompts]
            speeds[name].append(sum(len(t) - (1 if "llama-cpp-python" in name else 0) for t, _ in results) / sum(s for _, s in results))
            outputs[name] = [t for t, _ in results]
            if progress:
                progress()
        if program is not None and draft_path is not None:
            own_runs.append([_run_speculative_program(program, target_path, Path(draft_path), text, max_new_tokens, k, temperature, seed, threads,
                                                      n_ctx + 64) for text in texts])
            if progress:
                progress()
    reference = outputs["llama.cpp plain (llama-cpp-python)"]
    rows = []
    for name in systems:
        row = {"system": name, "tokens_per_s": statistics.median(speeds[name])}
        if name in stats:
            passes = stats[name].target_passes
            decode_s, inside_s, target_s = own[name]
            row.update(alpha_hat=stats[name].alpha_hat, beta=stats[name].beta if stats[name].proposed else None,
                       mean_tokens_per_pass=stats[name].mean_tokens_per_pass,
                       own_ms_per_pass=1e3 * (decode_s - inside_s) / passes,  # verispec's share: sampling, the rule, bookkeeping, copies
                       own_share_of_target_pass=(decode_s - inside_s) / target_s)
        if temperature == 0:
            row["identical_to_llamacpp_plain"] = outputs[name] == reference
        rows.append(row)
    if own_runs:
        row = {"system": speculative_name, "tokens_per_s": statistics.median(sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs) for runs in own_runs)}
        drafted, accepted = sum(r["drafted"] for r in own_runs[-1]), sum(r["accepted"] for r in own_runs[-1])
        row["alpha_hat"] = accepted / drafted if drafted else None
        if temperature == 0:  # it prints text: compare with llama.cpp plain's text, over what both produced
            plain_texts = [tokenizer.decode(t) for t in reference]
            row["identical_to_llamacpp_plain"] = all(a.startswith(b) or b.startswith(a) for a, b in
                                                     zip((r["text"] for r in own_runs[-1]), plain_texts))
        rows.append(row)
    base = rows[0]["tokens_per_s"]
    by_name = {row["system"]: row["tokens_per_s"] for row in rows}
    for row in rows:
        row["vs_llamacpp_plain"] = row["tokens_per_s"] / base
        row["vs_llamacpp_speculative"] = row["tokens_per_s"] / by_name[speculative_name] if own_runs else None
    return {"k": k, "max_new_tokens": max_new_tokens, "repeats": repeats, "prompts": len(prompts), "temperature": temperature,
            "threads": threads, "target": str(target_path), "draft": None if draft_path is None else str(draft_path),
            "target_description": target.config.description, "runs": rows,
            "note": "decode-only tokens/s (prefill excluded); alpha_hat = accepted / drafted tokens; own_ms_per_pass = verispec's "
                    "time per target pass outside llama.cpp's passes (sampling, the rule, bookkeeping, logits copies), "
                    "own_share_of_target_pass = that over the target pass's own time"}
