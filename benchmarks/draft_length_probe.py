"""Suffix drafting's draft lengths against verispec plain on one GGUF: `--k auto` (k_max 8, 16, 32) and fixed k.

    python benchmarks/draft_length_probe.py FILE.gguf PROMPTS.jsonl [--count 16] [--new 96] [--rounds 1]
        [--variants plain,auto8,auto16,auto32,k2,k4,k16]

In one process, each prompt decoded greedily by every variant in turn (interleaved), each variant's suffix
corpus spanning the round's prompts in order (as `bench` and a server keep it); prints per variant the median
over prompts of verispec plain's decode time over the variant's [min, max].
"""

from __future__ import annotations

import argparse
import json
import statistics

from verispec.assemble import Settings, load_target, prepare_engine
from verispec.config import SamplingParams
from verispec.drafters.suffix import SuffixDrafter
from verispec.engine import generate_all
from verispec.policy import AdaptiveLength
from verispec.stats import SpecStats


def _policy(variant: str):
    if variant.startswith("auto"):
        return AdaptiveLength(k_max=int(variant[4:]))
    return int(variant[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("prompts")
    parser.add_argument("--count", type=int, default=16, help="the first N prompts")
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variants", default="plain,auto8,auto16,auto32,k16")
    args = parser.parse_args()
    variants = args.variants.split(",")
    target, tokenizer = load_target(Settings(target=args.target, draft="none"))
    with open(args.prompts) as lines:
        prompts = [tokenizer.encode(json.loads(line)["prompt"]).ids for line in lines][: args.count]
    params = SamplingParams(temperature=0, max_new_tokens=args.new)
    prepare_engine(target, SuffixDrafter(), 33, 2)
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        drafters = {v: SuffixDrafter(keep_corpus=True) for v in variants}
        for prompt in prompts:
            seconds = {}
            for variant in variants:
                stats = SpecStats()
                plain = variant == "plain"
                drafter, k = (None, 0) if plain else (drafters[variant], _policy(variant))
                generate_all(target, [prompt], params, drafter, k, stats)
                seconds[variant] = stats.total_time_s - stats.prefill_time_s
            for variant in variants:
                ratios[variant].append(seconds["plain"] / seconds[variant])
    for variant, found in ratios.items():
        print(f"{variant:>8}: {statistics.median(found):.3f} [{min(found):.2f}, {max(found):.2f}]")


if __name__ == "__main__":
    main()
