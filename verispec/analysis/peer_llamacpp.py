"""The side-by-side with llama.cpp itself, on the same GGUF files (`verispec bench --peer llamacpp`).

Owns `run_llamacpp_peer_bench`. Batch 1, the same prompts, every system on each prompt in turn
(so that drift over a round lands on all of them alike), rounds repeated, medians over rounds
of decode-only tokens/s:
- verispec plain and verispec speculative at each draft length in `ks` (an int or "auto"; the
  draft model, or prompt lookup with `draft_path=None`), on llama.cpp (`LlamaCppModel`):
  decode = total time - prefill;
- llama.cpp plain through llama-cpp-python (`Llama.generate`, its own sampler): decode = from
  the first generated token on;
- llama.cpp's prompt lookup through llama-cpp-python (`LlamaPromptLookupDecoding`), with
  `draft_path=None`, at each integer k;
- llama.cpp's own speculative decoding, when `speculative_bin` names a directory holding
  `llama-speculative-simple` (built from the same llama.cpp version): the same target and draft
  files, `--spec-draft-n-max k` for each integer k, flash attention off like every other
  system here, its other settings at their defaults; its decode speed and acceptance are read
  from its log;
- with `ngram_types`, the same program's model-free n-gram drafters (`--spec-type ngram-mod`,
  ...; `llamacpp_program`), each at every length of `ngram_draft_lengths`, only each drafter's
  fastest length reported.
Every system generates max_new_tokens tokens per prompt, never stopping early (llama.cpp's
program may go a few tokens past, by its own rule). Greedy outputs are compared with llama.cpp
plain's: as token ids in this process, as text for the external program (which prints text).
For verispec, the time outside llama.cpp's passes (sampling, the rule, bookkeeping, copies of
the logits) is reported per target pass and as a share of the target pass's own time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..config import SamplingParams
from ..drafters.combined import CombinedDrafter
from ..drafters.model import ModelDrafter
from ..drafters.ngram import PromptLookupDrafter
from ..drafters.suffix import SuffixDrafter
from ..engine import generate_all
from ..llamacpp import GGUFTokenizer, LlamaCppModel, step_status
from ..policy import AdaptiveLength
from ..stats import SpecStats
from . import llamacpp_program
from .llamacpp_program import NGRAM_DRAFT_LENGTHS, ngram_lengths, ngram_system
from .profile import profile_costs

SPECULATIVE_PROGRAM = llamacpp_program.PROGRAM
PLAIN = "llama.cpp plain (llama-cpp-python)"


def _llama_cpp_python(path: Path, n_ctx: int, threads: int, lookup_k: int | None = None):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_k) if lookup_k else None
    return Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        draft_model=draft,
        logits_all=draft is not None,  # with a draft it keeps every row's logits, but sizes them by this flag
        verbose=False,
    )


def _run_llama_cpp_python(llm, prompt: list[int], max_new_tokens: int, temperature: float, seed: int) -> dict:
    """llama-cpp-python's generate, its prompt cache emptied first; decode timed from the first token."""
    llm.reset()
    llm.set_seed(seed)
    tokens, first = [], None
    sampling = (
        dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0) if temperature > 0 else dict(temp=0.0)
    )
    for token in llm.generate(prompt, reset=True, **sampling):
        tokens.append(int(token))
        if first is None:
            first = time.perf_counter()
        if len(tokens) == max_new_tokens:
            break
    return {"tokens": tokens, "decoded": len(tokens) - 1, "seconds": time.perf_counter() - first}


def run_llamacpp_peer_bench(
    target_path: str | Path,
    draft_path: str | Path | None,
    prompts: Sequence[str],
    ks: Sequence[int | str] = (4,),
    max_new_tokens: int = 128,
    repeats: int = 3,
    temperature: float = 0.0,
    seed: int = 0,
    threads: int | None = None,
    speculative_bin: str | Path | None = None,
    progress: Callable[[], None] | None = None,
    confidence_threshold: float = 0.0,
    ngram_types: Sequence[str] = (),
    ngram_draft_lengths: Sequence[int] = NGRAM_DRAFT_LENGTHS,
    suffix: bool = False,
) -> dict:
    """Median decode tokens/s per system, ratios to llama.cpp plain and to llama.cpp's own
    speculative decoding at its best k, acceptance, verispec's own share, and identity.
    Prompts are texts, encoded with the target GGUF's own vocabulary. `draft_path=None`
    compares prompt lookup (verispec's and llama-cpp-python's) instead. With a
    confidence_threshold every draft length of both model drafts runs twice, without it and
    with it (verispec's `ModelDrafter` and llama.cpp's program, `--spec-draft-p-min`: both
    stop drafting under the same rule), so that each side's best is taken over both.
    `ngram_types` (needs `speculative_bin`) adds llama.cpp's n-gram drafters, each at its best of
    `ngram_draft_lengths`. `suffix` adds verispec's suffix drafting (and suffix + the draft model, with
    one), whose corpus spans the prompts of a round in order (requests served one after another) and
    starts empty each round."""
    numeric = [k for k in ks if k != "auto"]
    if repeats < 1 or max_new_tokens < 2 or not ks or any(not isinstance(k, int) or k < 1 for k in numeric):
        raise ValueError(
            f"repeats must be >= 1, max_new_tokens >= 2 and ks integers >= 1 or 'auto', got {repeats}, "
            f"{max_new_tokens}, {list(ks)}"
        )
    if ngram_types and (speculative_bin is None or not ngram_draft_lengths or min(ngram_draft_lengths) < 1):
        raise ValueError(
            f"llama.cpp's n-gram drafters need --llama-cpp-bin and draft lengths >= 1, got "
            f"{speculative_bin}, {list(ngram_draft_lengths)}"
        )
    target_path = Path(target_path)
    target = LlamaCppModel(target_path, threads)
    draft = LlamaCppModel(draft_path, threads) if draft_path is not None else None
    threads = target.n_threads
    step = step_status()  # built (once) before anything is timed
    tokenizer = GGUFTokenizer(target)
    texts, prompts = list(prompts), [tokenizer.encode(text).ids for text in prompts]
    k_max = max(numeric or [8])
    n_ctx = max(map(len, prompts)) + max_new_tokens + k_max + 16
    params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=max_new_tokens)
    profile = None
    if "auto" in ks:
        profile = profile_costs(
            target, draft, k_max=k_max, context_length=round(statistics.mean(map(len, prompts)) + max_new_tokens / 2)
        )

    def verispec(k: int | str, threshold: float = 0.0, lookup: SuffixDrafter | None = None) -> Callable[[int], dict]:
        def run(i: int) -> dict:
            drafter = None if k == 0 else ModelDrafter(draft, threshold) if draft is not None else PromptLookupDrafter()
            if lookup is not None:  # suffix drafting, alone or before the draft model; a new corpus each round
                if i == 0:
                    lookup.clear_corpus()
                drafter = lookup if draft is None else CombinedDrafter(lookup, drafter)
            policy = AdaptiveLength(k_max=k_max, prior_c=profile.c or 0.0, prior_r=profile.r) if k == "auto" else k
            models = [target] + ([draft] if isinstance(drafter, (ModelDrafter, CombinedDrafter)) else [])
            inside_before, target_before = sum(m.forward_compute_s for m in models), target.forward_compute_s
            stats = SpecStats()
            tokens = generate_all(target, [prompts[i]], params, drafter, k=policy, stats=stats)[0]
            return {
                "tokens": tokens,
                "decoded": len(tokens),
                "seconds": stats.total_time_s - stats.prefill_time_s,
                "stats": stats,
                "inside": sum(m.forward_compute_s for m in models) - inside_before,
                "target": target.forward_compute_s - target_before,
            }

        return run

    plain = _llama_cpp_python(target_path, n_ctx, threads)
    systems: dict[str, Callable[[int], dict]] = {
        PLAIN: lambda i: _run_llama_cpp_python(plain, prompts[i], max_new_tokens, temperature, seed),
        "verispec plain": verispec(0),
    }
    # with a confidence threshold, every draft length runs both without it and with it, on both sides
    thresholds = [0.0] + ([confidence_threshold] if confidence_threshold > 0 and draft is not None else [])
    name = "verispec k={}" if draft is not None else "verispec prompt lookup k={}"
    for threshold in thresholds:
        for k in ks:
            systems[name.format(k) + (f", confidence {threshold:g}" if threshold else "")] = verispec(k, threshold)
    if suffix:
        for k in ks:
            name = "verispec suffix k={}" if draft is None else "verispec suffix+draft k={}"
            systems[name.format(k)] = verispec(k, lookup=SuffixDrafter(keep_corpus=True))
    if draft is None:
        for k in numeric:
            lookup = _llama_cpp_python(target_path, n_ctx, threads, lookup_k=k)
            systems[f"llama.cpp prompt lookup k={k} (llama-cpp-python)"] = lambda i, lookup=lookup: (
                _run_llama_cpp_python(lookup, prompts[i], max_new_tokens, temperature, seed)
            )
    program = _program(speculative_bin) if speculative_bin is not None else None

    def external(k: int, **spec) -> Callable[[int], dict]:  # llama.cpp's program on prompt i
        def run(i: int) -> dict:
            line = llamacpp_program.command(
                program, target_path, texts[i], max_new_tokens, temperature, seed, threads, n_ctx + 64 + k, k=k, **spec
            )
            return llamacpp_program.run(line, texts[i])

        return run

    if program is not None and draft is not None:
        for threshold in thresholds:
            for k in numeric:
                stop = f", p-min {threshold:g}" if threshold else ""
                systems[f"llama.cpp speculative k={k}{stop} ({SPECULATIVE_PROGRAM})"] = external(
                    k, draft=Path(draft_path), p_min=threshold
                )
    sweeps: dict[str, tuple[str, int]] = {}  # system name -> (n-gram drafter, draft length)
    for spec_type in ngram_types:
        for length in ngram_lengths(spec_type, ngram_draft_lengths):
            sweeps[ngram_system(spec_type, length)] = (spec_type, length)
            systems[ngram_system(spec_type, length)] = external(length, ngram=spec_type)
    rounds: dict[str, list[list[dict]]] = {name: [] for name in systems}
    for _ in range(repeats):  # every system on one prompt, then the next: drift over a round lands on all of them alike
        results: dict[str, list[dict]] = {name: [] for name in systems}
        for i in range(len(prompts)):
            for system, run in systems.items():
                results[system].append(run(i))
        for system in systems:
            rounds[system].append(results[system])
        if progress:
            progress()
    return _report(
        rounds,
        tokenizer,
        dict(
            ks=list(ks),
            compiled_step=step,
            confidence_threshold=confidence_threshold,
            max_new_tokens=max_new_tokens,
            repeats=repeats,
            prompts=len(prompts),
            temperature=temperature,
            threads=threads,
            target=str(target_path),
            draft=None if draft_path is None else str(draft_path),
            target_description=target.config.description,
            draft_description=None if draft is None else draft.config.description,
            profile=None if profile is None else profile.to_dict(),
            ngram_types=list(ngram_types),
            ngram_draft_lengths=list(ngram_draft_lengths) if ngram_types else [],
            note="decode-only tokens/s (prefill excluded); alpha_hat = accepted / drafted tokens; "
            "own_ms_per_pass = verispec's time per target pass outside llama.cpp's passes "
            "(sampling, the rule, bookkeeping, logits copies); "
            "own_share_of_target_pass = that over the target pass's own time",
        ),
        sweeps,
    )


def _program(directory: str | Path) -> Path:
    program = Path(directory) / SPECULATIVE_PROGRAM
    if not program.is_file():
        raise ValueError(
            f"--llama-cpp-bin {directory}: no {SPECULATIVE_PROGRAM} there "
            "(benchmarks/build_llama_speculative.sh builds it)"
        )
    return program


def _report(
    rounds: dict[str, list[list[dict]]],
    tokenizer: GGUFTokenizer,
    header: dict,
    sweeps: dict[str, tuple[str, int]] | None = None,
) -> dict:
    """The report's rows: per system, median tokens/s, acceptance and identity; each n-gram
    drafter of `sweeps` (system name -> (drafter, length)) kept at its fastest length."""
    reference = [r["tokens"] for r in rounds[PLAIN][-1]]
    reference_text = [tokenizer.decode(t) for t in reference]
    own_plain = [r["tokens"] for r in rounds["verispec plain"][-1]] if "verispec plain" in rounds else None
    rows = []
    for system, runs in rounds.items():
        row = {
            "system": system,
            "tokens_per_s": statistics.median(
                sum(r["decoded"] for r in rs) / sum(r["seconds"] for r in rs) for rs in runs
            ),
        }
        last = runs[-1]
        if "stats" in last[0]:
            stats = SpecStats()
            for result in (r for rs in runs for r in rs):
                stats.add(result["stats"].requests[0])
            decode_s, inside_s, target_s = (
                sum(r[key] for rs in runs for r in rs) for key in ("seconds", "inside", "target")
            )
            row.update(
                alpha_hat=stats.alpha_hat if stats.proposed else None,
                beta=stats.beta if stats.proposed else None,
                mean_tokens_per_pass=stats.mean_tokens_per_pass,
                own_ms_per_pass=1e3 * (decode_s - inside_s) / stats.target_passes,
                own_share_of_target_pass=(decode_s - inside_s) / target_s,
            )
        elif "drafted" in last[0]:
            drafted = sum(r["drafted"] for r in last)
            row["alpha_hat"] = sum(r["accepted"] for r in last) / drafted if drafted else None
        if header["temperature"] == 0:
            if "tokens" in last[0]:
                same = [r["tokens"] == tokens for r, tokens in zip(last, reference)]
            else:  # text, over what both produced (the program may decode a few tokens more)
                same = [a.startswith(b) or b.startswith(a) for a, b in zip((r["text"] for r in last), reference_text)]
            row["identical_to_llamacpp_plain"], row["identical_prompts"] = all(same), sum(same)
            if (
                own_plain is not None and system.startswith("verispec") and "tokens" in last[0]
            ):  # exactness: speculative = plain
                row["identical_to_verispec_plain"] = all(r["tokens"] == tokens for r, tokens in zip(last, own_plain))
        rows.append(row)
    rows = llamacpp_program.keep_best_lengths(rows, sweeps or {})
    base = rows[0]["tokens_per_s"]
    own = [row["tokens_per_s"] for row in rows if row["system"].startswith("llama.cpp speculative")]
    ngram = [row["tokens_per_s"] for row in rows if "draft_length_sweep" in row]
    for row in rows:
        row["vs_llamacpp_plain"] = row["tokens_per_s"] / base
        row["vs_llamacpp_speculative_best"] = row["tokens_per_s"] / max(own) if own else None
        row["vs_llamacpp_ngram_best"] = row["tokens_per_s"] / max(ngram) if ngram else None
    return {**header, "runs": rows}
