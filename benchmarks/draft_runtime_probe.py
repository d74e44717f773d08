"""A trained draft (`verispec train draft --target`) run different ways against verispec plain, on one GGUF.

    python benchmarks/draft_runtime_probe.py TARGET.gguf DRAFT.gguf PROMPTS.jsonl [--count 16] [--new 128]
        [--rounds 2] [--variants f32-t1,f32-t2] [--k 1,2,auto]

The draft's weights in float32 or int8 (verispec's own int8 path: slow here, no kernel for it beside llama.cpp), torch
on 1 or 2 threads, each at every k, in one
process; each prompt decoded greedily by plain decoding and every (variant, k) in turn (interleaved). Prints per
(variant, k) the median over prompts of plain's decode time over the variant's, [min, max], and the acceptance;
and whether every greedy output equals plain's.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from verispec.assemble import Settings, load_target, prepare_engine
from verispec.config import SamplingParams
from verispec.drafters.model import ModelDrafter
from verispec.engine import generate_all
from verispec.models.kernels import calibrate
from verispec.models.quantize import quantize_model
from verispec.policy import AdaptiveLength
from verispec.stats import SpecStats
from verispec.training.draft_export import load_subset_draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("prompts")
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default="f32-t1,f32-t2")
    parser.add_argument("--k", default="1,2,auto")
    args = parser.parse_args()
    target, tokenizer = load_target(Settings(target=args.target, draft="none"))
    with open(args.prompts) as lines:
        prompts = [tokenizer.encode(json.loads(line)["prompt"]).ids for line in lines][: args.count]
    params = SamplingParams(temperature=0, max_new_tokens=args.new)
    models = {}
    for variant in args.variants.split(","):
        weights, threads = variant.split("-")
        model = load_subset_draft(args.draft)
        if weights == "int8":
            model = quantize_model(model, 8)
        calibrate(model, 4)
        models[variant] = (model, int(threads[1:]))
    prepare_engine(target, ModelDrafter(next(iter(models.values()))[0]), 1, 1)
    lengths = [AdaptiveLength(k_max=8) if k == "auto" else int(k) for k in args.k.split(",")]
    names = [f"{v} k={k}" for v in models for k in args.k.split(",")]
    ratios: dict[str, list[float]] = {n: [] for n in names}
    accepted = {n: [0, 0] for n in names}
    same = {n: True for n in names}
    warm = SamplingParams(temperature=0, max_new_tokens=8)
    generate_all(target, prompts[:1], warm)  # first-use measurements (attention regime, deviation) out of the timing
    for model, threads in models.values():
        torch.set_num_threads(threads)
        generate_all(target, prompts[:1], warm, ModelDrafter(model), 2)
    for _ in range(args.rounds):
        for prompt in prompts:
            torch.set_num_threads(1)
            stats = SpecStats()
            plain = generate_all(target, [prompt], params, None, 0, stats)
            base = stats.total_time_s - stats.prefill_time_s
            for variant, (model, threads) in models.items():
                for k, name in zip(lengths, [n for n in names if n.startswith(variant + " ")]):
                    torch.set_num_threads(threads)
                    stats = SpecStats()
                    out = generate_all(target, [prompt], params, ModelDrafter(model), k, stats)
                    ratios[name].append(base / (stats.total_time_s - stats.prefill_time_s))
                    accepted[name][0] += stats.accepted
                    accepted[name][1] += stats.proposed
                    same[name] &= out == plain
    for name in names:
        found = ratios[name]
        alpha = accepted[name][0] / max(accepted[name][1], 1)
        print(
            f"{name:>16}: {statistics.median(found):.3f} [{min(found):.2f}, {max(found):.2f}]  alpha {alpha:.3f}"
            f"  identical {same[name]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
