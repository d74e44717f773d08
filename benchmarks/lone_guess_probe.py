"""Plain decoding with and without the placeholder's guess, interleaved, on one GGUF file.

    python benchmarks/lone_guess_probe.py FILE.gguf [--prompts benchmarks/heldout.jsonl] [--count 8]
        [--new 384] [--rounds 2] [--temperature 0]

Each prompt is decoded plainly (`generate_all(..., None, k=0)`) twice per round: with the guess
(drafters/placeholder.py: a one-token suffix guess where a lone one-position pass carries a
placeholder) and with `VERISPEC_PLACEHOLDER_GUESS=0` (the placeholder a copy, or in the spare
sequence), the order alternating by prompt and round. Asserts the tokens are the same, and prints
per prompt the decode-only speed ratio (guess over none; medians over rounds), the guesses made and
right, and the median over prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from verispec.config import SamplingParams
from verispec.engine import generate_all
from verispec.models.backend import load, load_text_tokenizer
from verispec.stats import SpecStats


def decode(target, prompt: list[int], params: SamplingParams, guess: bool) -> tuple[list[int], SpecStats]:
    os.environ["VERISPEC_PLACEHOLDER_GUESS"] = "1" if guess else "0"
    stats = SpecStats()
    return generate_all(target, [prompt], params, None, k=0, stats=stats)[0], stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("--prompts", default="benchmarks/heldout.jsonl")
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--new", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    target, _ = load(args.target, "llamacpp")
    tokenizer = load_text_tokenizer(args.target, target)
    with open(args.prompts) as lines:
        prompts = [list(tokenizer.encode(json.loads(line)["prompt"]).ids) for line in lines][: args.count]
    print(f"{args.target}: lone_pad_from {target.lone_pad_from}, {len(prompts)} prompts, {args.new} new tokens")
    seconds: dict[tuple[int, bool], list[float]] = {}
    guessed: dict[int, tuple[int, int]] = {}
    for round_ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=args.temperature, max_new_tokens=args.new, seed=i)
            tokens = {}
            for guess in (True, False) if (round_ + i) % 2 == 0 else (False, True):
                tokens[guess], stats = decode(target, prompt, params, guess)
                seconds.setdefault((i, guess), []).append(stats.total_time_s - stats.prefill_time_s)
                if guess:
                    guessed[i] = (stats.accepted, stats.proposed)
            assert tokens[True] == tokens[False], f"prompt {i}: the guess changed the tokens"
    ratios = []
    for i in range(len(prompts)):
        ratio = statistics.median(seconds[(i, False)]) / statistics.median(seconds[(i, True)])
        ratios.append(ratio)
        right, made = guessed[i]
        print(f"prompt {i} ({len(prompts[i])} tokens): {ratio:.2f}x, guesses right {right}/{made}")
    low, high = min(ratios), max(ratios)
    print(f"guess over none, decode only: median {statistics.median(ratios):.2f}x [{low:.2f}, {high:.2f}]")


if __name__ == "__main__":
    main()
