"""The side-by-side with llama.cpp itself, on the same GGUF files (`verispec bench --peer llamacpp`).

Owns `run_llamacpp_peer_bench`. Batch 1, the same prompts, every system on each (prompt, seed) pair
in turn (seeds outer, prompts inner: so that drift over a round lands on all of them alike, and a
suffix corpus and `--k auto`'s policy span one seed's prompts, as a process serving them keeps
one), rounds repeated; per system and pair the median over rounds
of decode-only tokens/s (report: `peer_report`):
- verispec plain and verispec speculative at each draft length in `ks` (an int or "auto"; the
  draft model, or prompt lookup with `draft_path=None`), on llama.cpp (`LlamaCppModel`):
  decode = total time - prefill;
- llama.cpp plain through llama-cpp-python (`Llama.generate`): decode = from the first generated
  token on;
- llama.cpp's prompt lookup through llama-cpp-python (`LlamaPromptLookupDecoding`), with
  `draft_path=None`, at each integer k;
- llama.cpp's own speculative decoding, when `speculative_bin` names a directory holding
  `llama-speculative-simple` (built from the same llama.cpp version): the same target and draft
  files, `--spec-draft-n-max k` for each integer k, its other settings at their defaults; its
  decode speed and acceptance are read from its log;
- with `ngram_types`, the same program's model-free n-gram drafters (`--spec-type ngram-mod`,
  ...; `llamacpp_program`), each at every length of `ngram_draft_lengths`, only each drafter's
  fastest length reported; with `suffix` and a draft too, each chained before the draft model
  (`--spec-type ngram-mod,draft-simple`) at the first integer k, llama.cpp's counterpart of
  verispec's suffix+draft.
Every llama.cpp system runs the attention verispec's target context runs (`flash_attention`:
llama-cpp-python's flash_attn, the program's -fa), so that both sides run the same kernels.
Every system samples one distribution: temperature, top-k, top-p, min-p in verispec's order (`process_logits`);
llama.cpp's program by `--samplers` (`llamacpp_program.sampler_names`), llama-cpp-python by `ordered_sampler`
(its own chain puts temperature last). How llama.cpp speculates at T > 0:
- its draft (draft-simple) proposes its most likely token (top-k 10, no temperature, nothing sampled);
- its target samples each position and keeps a proposal while the sample equals it (acceptance p(x));
llama-cpp-python's prompt lookup proposes deterministically and keeps proposals the same way.
Every system generates max_new_tokens tokens per prompt, never stopping early (llama.cpp's
program may go a few tokens past, by its own rule). Greedy outputs are compared with llama.cpp
plain's: as token ids in this process, as text for the external program (which prints text).
For verispec, the time outside llama.cpp's passes (sampling, the rule, bookkeeping, copies of
the logits) is reported per target pass and as a share of the target pass's own time.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

from ..config import SamplingParams
from ..drafters.combined import CombinedDrafter
from ..drafters.model import ModelDrafter
from ..drafters.ngram import PromptLookupDrafter
from ..drafters.suffix import SuffixDrafter
from ..engine import generate_all
from ..llamacpp import GGUFTokenizer, LlamaCppModel, exact_kernels, step_status
from ..policy import AdaptiveLength
from ..stats import SpecStats
from . import llamacpp_program
from .llamacpp_program import DRAFT_SIMPLE, NGRAM_DRAFT_LENGTHS, SEED_LIMIT, ngram_lengths, ngram_system, sampler_names
from .peer_report import PLAIN, report
from .profile import profile_costs

SPECULATIVE_PROGRAM = llamacpp_program.PROGRAM


def ordered_sampler(params: SamplingParams, seed: int):
    """A llama-cpp-python sampler chain (`_internals.LlamaSampler`) that samples what verispec
    samples: the samplers of `sampler_names` in that order, then a seeded draw; greedy at T = 0."""
    from llama_cpp._internals import LlamaSampler

    sampler = LlamaSampler()
    if params.greedy:
        sampler.add_greedy()
        return sampler
    add = {
        "top_k": lambda: sampler.add_top_k(params.top_k),
        "temperature": lambda: sampler.add_temp(params.temperature),
        "top_p": lambda: sampler.add_top_p(params.top_p, 1),
        "min_p": lambda: sampler.add_min_p(params.min_p, 1),
    }
    for name in sampler_names(params):
        add[name]()
    sampler.add_dist(seed)
    return sampler


@cache
def _ordered_llama():
    """llama_cpp.Llama whose generate samples with `ordered_sampler` (its own chain is top-k, typical-p,
    top-p, min-p, then temperature)."""
    from llama_cpp import Llama

    class OrderedLlama(Llama):
        def _init_sampler(self, top_k=0, top_p=1.0, min_p=0.0, temp=0.0, **_ignored):  # generate's settings
            params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
            return ordered_sampler(params, self._seed)

    return OrderedLlama


def _llama_cpp_python(path: Path, n_ctx: int, threads: int, flash: bool, lookup_k: int | None = None):
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_k) if lookup_k else None
    return _ordered_llama()(
        model_path=str(path),
        n_ctx=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        draft_model=draft,
        logits_all=draft is not None,  # with a draft it keeps every row's logits, but sizes them by this flag
        flash_attn=flash,
        verbose=False,
    )


def _run_llama_cpp_python(llm, prompt: list[int], max_new_tokens: int, params: SamplingParams) -> dict:
    """llama-cpp-python's generate, its prompt cache emptied first; decode timed from the first token."""
    llm.reset()
    llm.set_seed(params.seed)
    tokens, first = [], None
    sampling = dict(temp=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
    for token in llm.generate(prompt, reset=True, **sampling):
        tokens.append(int(token))
        if first is None:
            first = time.perf_counter()
        if len(tokens) == max_new_tokens:
            break
    return {"tokens": tokens, "decoded": len(tokens) - 1, "seconds": time.perf_counter() - first}


def _check(ks, max_new_tokens, repeats, seeds, ngram_types, ngram_draft_lengths, speculative_bin) -> None:
    numeric = [k for k in ks if k != "auto"]
    if repeats < 1 or max_new_tokens < 2 or not ks or any(not isinstance(k, int) or k < 1 for k in numeric):
        raise ValueError(
            f"repeats must be >= 1, max_new_tokens >= 2 and ks integers >= 1 or 'auto', got {repeats}, "
            f"{max_new_tokens}, {list(ks)}"
        )
    if not seeds or any(not isinstance(s, int) or not 0 <= s < SEED_LIMIT for s in seeds):
        raise ValueError(f"--seed: llama.cpp's seeds are integers in [0, 2**32 - 1), got {list(seeds)}")
    if ngram_types and (speculative_bin is None or not ngram_draft_lengths or min(ngram_draft_lengths) < 1):
        raise ValueError(
            f"llama.cpp's n-gram drafters need --llama-cpp-bin and draft lengths >= 1, got "
            f"{speculative_bin}, {list(ngram_draft_lengths)}"
        )


def run_llamacpp_peer_bench(
    target_path: str | Path,
    draft_path: str | Path | None,
    prompts: Sequence[str],
    ks: Sequence[int | str] = (4,),
    max_new_tokens: int = 128,
    repeats: int = 3,
    sampling: SamplingParams | None = None,
    seeds: Sequence[int] = (0,),
    threads: int | None = None,
    speculative_bin: str | Path | None = None,
    progress: Callable[[], None] | None = None,
    confidence_threshold: float = 0.0,
    draft_temperature: float | None = None,
    ngram_types: Sequence[str] = (),
    ngram_draft_lengths: Sequence[int] = NGRAM_DRAFT_LENGTHS,
    suffix: bool = False,
) -> dict:
    """Median decode tokens/s per system, ratios to llama.cpp plain and to llama.cpp's own
    speculative decoding at its best k (medians over (prompt, seed) pairs, with their range),
    acceptance per proposal, verispec's own share and proposal temperature, and identity.
    `sampling` gives temperature, top-k, top-p and min-p (its seed is ignored: each pair has one of
    `seeds`; default greedy). Prompts are texts, encoded with the target GGUF's own vocabulary.
    `draft_path=None` compares prompt lookup (verispec's and llama-cpp-python's) instead. With a
    confidence_threshold every draft length of both model drafts runs twice, without it and
    with it (verispec's `ModelDrafter` and llama.cpp's program, `--spec-draft-p-min`: both
    stop drafting under the same rule), so that each side's best is taken over both. verispec's draft
    model proposes at `draft_temperature` (None: auto, `ModelDrafter`'s choice by measured acceptance).
    `ngram_types` (needs `speculative_bin`) adds llama.cpp's n-gram drafters, each at its best of
    `ngram_draft_lengths`. `suffix` adds verispec's suffix drafting, whose corpus spans one seed's
    prompts of a round in order (requests served one after another) and starts empty at each seed's
    first prompt; with a draft model also suffix + the draft, verispec's prompt lookup and llama.cpp's
    n-gram drafters chained before the draft. `verispec_side` records what verispec's side ran, read back at run
    time: exact kernels (the library's process-wide setting), flash attention (the target's), its threads."""
    _check(ks, max_new_tokens, repeats, seeds, ngram_types, ngram_draft_lengths, speculative_bin)
    sampling = SamplingParams(temperature=0.0) if sampling is None else sampling
    sampling = dataclasses.replace(sampling, max_new_tokens=max_new_tokens, seed=None)
    target_path = Path(target_path)
    target = LlamaCppModel(target_path, threads)
    draft = LlamaCppModel(draft_path, threads) if draft_path is not None else None
    threads = target.n_threads
    step = step_status()  # built (once) before anything is timed
    tokenizer = GGUFTokenizer(target)
    texts, prompts = list(prompts), [tokenizer.encode(text).ids for text in prompts]
    numeric = [k for k in ks if k != "auto"]
    k_max = max(numeric or [8])
    n_ctx = max(map(len, prompts)) + max_new_tokens + k_max + 16
    profile = None
    if "auto" in ks:
        profile = profile_costs(
            target, draft, k_max=k_max, context_length=round(statistics.mean(map(len, prompts)) + max_new_tokens / 2)
        )

    def verispec(k: int | str, threshold: float = 0.0, lookup: SuffixDrafter | None = None, model: bool = True):
        policies: list[AdaptiveLength] = []  # with k = "auto": one policy per seed's round, as a process keeps one
        model = model and draft is not None

        def run(i: int, seed: int) -> dict:
            drafter = (
                None
                if k == 0
                else ModelDrafter(draft, threshold, draft_temperature)
                if model
                else PromptLookupDrafter()
            )
            if lookup is not None:  # suffix drafting, alone or before the draft model; a new corpus per seed's round
                if i == 0:
                    lookup.clear_corpus()
                drafter = CombinedDrafter(lookup, drafter) if model else lookup
            if k == "auto" and (i == 0 or not policies):
                policies[:] = [AdaptiveLength(k_max=k_max, prior_c=profile.c or 0.0, prior_r=profile.r)]
            policy = policies[0] if k == "auto" else k
            models = [target] + ([draft] if isinstance(drafter, (ModelDrafter, CombinedDrafter)) else [])
            inside_before, target_before = sum(m.forward_compute_s for m in models), target.forward_compute_s
            stats, proposal = SpecStats(), _proposal(drafter)
            params = dataclasses.replace(sampling, seed=seed)
            tokens = generate_all(target, [prompts[i]], params, drafter, k=policy, stats=stats)[0]
            return {
                "tokens": tokens,
                "decoded": len(tokens),
                "seconds": stats.total_time_s - stats.prefill_time_s,
                "stats": stats,
                "inside": sum(m.forward_compute_s for m in models) - inside_before,
                "target": target.forward_compute_s - target_before,
                "proposal": proposal.summary() if proposal is not None else None,
            }

        return run

    def python(llm) -> Callable[[int, int], dict]:  # llama-cpp-python on prompt i with one seed
        return lambda i, seed: _run_llama_cpp_python(
            llm, prompts[i], max_new_tokens, dataclasses.replace(sampling, seed=seed)
        )

    # the attention verispec's target contexts run (context.py: flash attention only under exact kernels, as
    # regime.py chose; sgemm's otherwise): every llama.cpp system runs it too
    flash = target.shape_invariant and target.flash_attention
    systems: dict[str, Callable[[int, int], dict]] = {
        PLAIN: python(_llama_cpp_python(target_path, n_ctx, threads, flash)),
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
            systems[f"verispec suffix k={k}"] = verispec(k, lookup=SuffixDrafter(keep_corpus=True), model=False)
            if draft is not None:  # the combination, and prompt lookup beside it: the model-free drafters it is held to
                systems[f"verispec suffix+draft k={k}"] = verispec(k, lookup=SuffixDrafter(keep_corpus=True))
                systems[f"verispec prompt lookup k={k}"] = verispec(k, model=False)
    if draft is None:
        for k in numeric:
            lookup = _llama_cpp_python(target_path, n_ctx, threads, flash, lookup_k=k)
            systems[f"llama.cpp prompt lookup k={k} (llama-cpp-python)"] = python(lookup)
    program = _program(speculative_bin) if speculative_bin is not None else None

    def external(k: int, **spec) -> Callable[[int, int], dict]:  # llama.cpp's program on prompt i with one seed
        def run(i: int, seed: int) -> dict:
            params = dataclasses.replace(sampling, seed=seed)
            line = llamacpp_program.command(
                program,
                target_path,
                texts[i],
                max_new_tokens,
                params,
                threads,
                n_ctx + 64 + k,
                k=k,
                flash=flash,
                **spec,
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
    if suffix and program is not None and draft is not None and numeric:  # llama.cpp's own chains, n-gram then draft
        for spec_type in ngram_types:
            chain = f"{spec_type},{DRAFT_SIMPLE} k={numeric[0]}"
            for length in ngram_lengths(spec_type, ngram_draft_lengths):
                sweeps[ngram_system(chain, length)] = (chain, length)
                systems[ngram_system(chain, length)] = external(
                    numeric[0], ngram=spec_type, ngram_length=length, draft=Path(draft_path)
                )
    pairs = pair_order(len(prompts), seeds)
    results = interleave(systems, pairs, repeats, progress)
    return report(
        results,
        pairs,
        tokenizer,
        dict(
            ks=list(ks),
            compiled_step=step,
            confidence_threshold=confidence_threshold,
            draft_temperature="auto" if draft_temperature is None else draft_temperature,
            max_new_tokens=max_new_tokens,
            repeats=repeats,
            prompts=len(prompts),
            seeds=list(seeds),
            pairs=len(pairs),
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            min_p=sampling.min_p,
            llama_cpp_samplers=";".join(sampler_names(sampling)),
            threads=threads,
            # what verispec's side ran, read back from the library and the loaded target
            verispec_side=dict(exact_kernels=exact_kernels(), flash_attention=bool(flash), threads=target.n_threads),
            target=str(target_path),
            draft=None if draft_path is None else str(draft_path),
            target_description=target.config.description,
            draft_description=None if draft is None else draft.config.description,
            profile=None if profile is None else profile.to_dict(),
            ngram_types=list(ngram_types),
            ngram_draft_lengths=list(ngram_draft_lengths) if ngram_types else [],
            note="decode-only tokens/s (prefill excluded), per (prompt, seed) pair the median over rounds, "
            "per system the median over pairs; ratios: the median of per-pair ratios, [min, max] in *_range; "
            "alpha_hat = accepted / drafted tokens, pooled (alpha_hat_range: per pair); "
            "own_ms_per_pass = verispec's time per target pass outside llama.cpp's passes "
            "(sampling, the rule, bookkeeping, logits copies); "
            "own_share_of_target_pass = that over the target pass's own time",
        ),
        sweeps,
    )


def pair_order(n_prompts: int, seeds: Sequence[int]) -> list[tuple[int, int]]:
    """The (prompt index, seed) pairs in the order they run: each seed's prompts in turn."""
    return [(i, seed) for seed in dict.fromkeys(seeds) for i in range(n_prompts)]


def interleave(
    systems: dict[str, Callable[[int, int], dict]],
    pairs: list[tuple[int, int]],
    repeats: int,
    progress: Callable[[], None] | None = None,
) -> dict[str, list[list[dict]]]:
    """Every system on one (prompt, seed) pair, then the next, round after round: results[system][pair]
    lists that pair's runs, one per round."""
    results: dict[str, list[list[dict]]] = {name: [[] for _ in pairs] for name in systems}
    for _ in range(repeats):
        for p, (i, seed) in enumerate(pairs):
            for system, run in systems.items():
                results[system][p].append(run(i, seed))
        if progress:
            progress()
    return results


def _proposal(drafter):
    """The drafter's proposal temperature (`proposal.ProposalTemperature`), where it has one; the model
    drafter's of a combined draft."""
    return getattr(drafter, "proposal", None) or getattr(getattr(drafter, "drafter", None), "proposal", None)


def _program(directory: str | Path) -> Path:
    program = Path(directory) / SPECULATIVE_PROGRAM
    if not program.is_file():
        raise ValueError(
            f"--llama-cpp-bin {directory}: no {SPECULATIVE_PROGRAM} there "
            "(benchmarks/build_llama_speculative.sh builds it)"
        )
    return program
