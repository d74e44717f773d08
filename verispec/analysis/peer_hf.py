"""The side-by-side with what users already have: `transformers`' generate, on the same weights.

Owns `run_peer_bench`: greedy decoding of the same prompts, batch 1, by
- verispec plain decoding and verispec speculative decoding at draft length k;
- transformers' plain `generate`, `generate(assistant_model=draft)` with
  `num_assistant_tokens = k` and the "constant" schedule, and, when asked,
  `generate(prompt_lookup_num_tokens = k)` next to verispec's prompt-lookup drafter.
Every system runs once per repeat, in the same order, so drift lands on all of them; the
report gives median tokens/s, the ratios to transformers' plain and assisted generation, and
whether every system produced the same tokens (float32 greedy should). A difference (expected
in bfloat16) is reported with the first position where it happens and why: the gap between
the target's two best logits there (transformers' own pass over the common prefix), a
near-tie that rounding decides one way or the other. Every run generates exactly
max_new_tokens (no stop token), so tokens/s compare like with like.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..config import SamplingParams
from ..drafters.model import ModelDrafter
from ..drafters.ngram import PromptLookupDrafter
from ..engine import generate_all
from ..models.hf import load_model


def _hf_generate(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=0,
        eos_token_id=None,
        **kwargs,
    )
    return out[0, len(prompt) :].tolist()


def _systems(
    target_dir: str | Path,
    draft_dir: str | Path | None,
    k: int,
    max_new_tokens: int,
    prompt_lookup: bool,
    dtype: torch.dtype,
    load: Callable,
) -> tuple[dict[str, Callable[[list[int]], list[int]]], torch.nn.Module]:
    import transformers

    target = load(target_dir)
    hf_target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    systems: dict[str, Callable[[list[int]], list[int]]] = {
        "verispec plain": lambda p: generate_all(target, [p], params)[0],
        "transformers plain": lambda p: _hf_generate(hf_target, p, max_new_tokens),
    }
    if draft_dir is not None:
        draft = load(draft_dir)
        hf_draft = transformers.AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval()
        hf_draft.generation_config.num_assistant_tokens = k
        hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
        systems[f"verispec k={k}"] = lambda p: generate_all(target, [p], params, ModelDrafter(draft), k=k)[0]
        systems[f"transformers assisted k={k}"] = lambda p: _hf_generate(
            hf_target, p, max_new_tokens, assistant_model=hf_draft
        )
    if prompt_lookup:
        systems[f"verispec prompt lookup k={k}"] = lambda p: generate_all(
            target, [p], params, PromptLookupDrafter(), k=k
        )[0]
        systems[f"transformers prompt lookup k={k}"] = lambda p: _hf_generate(
            hf_target, p, max_new_tokens, prompt_lookup_num_tokens=k
        )
    return systems, hf_target


@torch.no_grad()
def explain_difference(
    hf_target: torch.nn.Module, prompt: list[int], reference: list[int], other: list[int]
) -> dict | None:
    """Where two greedy outputs first differ and the target's top-2 logit gap there (None if equal)."""
    position = next((j for j, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    if position is None:
        return None
    logits = hf_target(torch.tensor([list(prompt) + reference[:position]])).logits[0, -1].float()
    top = logits.topk(2)
    return {
        "position": position,
        "tokens": [reference[position], other[position]],
        "top2_gap": float(top.values[0] - top.values[1]),
        "second_choice": int(top.indices[1]) == other[position],
    }


@torch.no_grad()
def run_peer_bench(
    target_dir: str | Path,
    draft_dir: str | Path | None,
    prompts: Sequence[Sequence[int]],
    k: int = 4,
    max_new_tokens: int = 64,
    repeats: int = 3,
    prompt_lookup: bool = False,
    dtype: torch.dtype = torch.float32,
    load: Callable | None = None,
) -> dict:
    """Median tokens/s per system, ratios to transformers, and output identity (with the
    first difference explained by the target's logit gap there). `load(path)` gives verispec's
    models (any backend; default: `models.hf.load_model` in `dtype`, on PyTorch)."""
    if repeats < 1 or k < 1:
        raise ValueError(f"repeats and k must be >= 1, got {repeats} and {k}")
    load = load or (lambda path: load_model(path, dtype))
    systems, hf_target = _systems(target_dir, draft_dir, k, max_new_tokens, prompt_lookup, dtype, load)
    speeds: dict[str, list[float]] = {name: [] for name in systems}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for name, run in systems.items():
            started = time.perf_counter()
            produced = [run(list(p)) for p in prompts]
            speeds[name].append(sum(map(len, produced)) / (time.perf_counter() - started))
            outputs[name] = produced
    reference = outputs["transformers plain"]
    rows = []
    for name in systems:
        first = next(
            (
                (i, d)
                for i, (a, b) in enumerate(zip(reference, outputs[name]))
                if (d := explain_difference(hf_target, prompts[i], a, b))
            ),
            None,
        )
        rows.append(
            {
                "system": name,
                "tokens_per_s": statistics.median(speeds[name]),
                "identical_to_transformers_plain": first is None,
                "first_difference": None if first is None else {"prompt": first[0], **first[1]},
            }
        )
    by_name = {row["system"]: row["tokens_per_s"] for row in rows}
    for row in rows:
        row["vs_transformers_plain"] = row["tokens_per_s"] / by_name["transformers plain"]
        assisted = by_name.get(f"transformers assisted k={k}")
        row["vs_transformers_assisted"] = row["tokens_per_s"] / assisted if assisted else None
    return {
        "k": k,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "prompts": len(prompts),
        "dtype": str(dtype).removeprefix("torch."),
        "runs": rows,
    }
