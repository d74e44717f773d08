"""How much better suffix drafting's proposal lengths could do: an offline replay of greedy completions.

    python benchmarks/suffix_replay.py FILE.gguf [--profile BENCH.json] [--prompts FILE] [--max-prompts 16]

Decodes each prompt greedily (verispec plain, `--max-new-tokens`), then replays the completions
through `SuffixDrafter` as `bench --peer-suffix` runs it (one corpus over the prompts, in order).
Greedy acceptance is known from the completion, so each rule's passes and their cost follow
exactly; the cost of a pass of n positions is the `profile.r` of a `bench --json` file (measured
on the same file and machine), or without `--profile` r(1..17) measured here first
(`profile_costs`: one row, at the bucket of the median context of the completions' passes, the
installed verispec's settings). Prints tokens per plain pass's cost (the speed-up over plain decoding,
verispec's own time excluded) for:
- `rule`: the drafter's own stopping rule at k = 16 (what bench ran);
- `learned`: per proposal, the length L maximizing (1 + sum_i prod_{j<=i} a_j) / r(L + 1), with a_j
  the acceptance so far of tokens proposed after matches of the same length class and with the
  same agreement (Beta(1, 1) prior, learned from the passes already replayed);
- `learned + guess`: and a one-token guess (a one-token match) where nothing is proposed and
  r(2) <= r(1) (the pass carries a placeholder anyway);
- `oracle`: every proposal cut where it would fail.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict

from verispec.analysis.profile import profile_costs
from verispec.config import SamplingParams
from verispec.drafters.suffix import SuffixDrafter, _Row
from verispec.engine import generate_all
from verispec.models.backend import load, load_text_tokenizer


def walk(drafter: SuffixDrafter, row: _Row, k: int) -> tuple[list[int], list[float], int]:
    """The walk's tokens, each step's agreement fraction, and the match length (drafter.walk's path)."""
    history = row.tokens
    matched, occurrences = drafter.match(row)
    tokens, fractions, end = [], [], len(history)
    while occurrences and len(tokens) < k:
        following = [
            (history[p] if p < end else tokens[p - end], s, p) if s is history else (s[p], s, p)
            for s, p in occurrences
            if s is history or p < len(s)
        ]
        if not following:
            break
        counts: dict[int, int] = {}
        for token, _, _ in following:
            counts[token] = counts.get(token, 0) + 1
        token = max(counts, key=counts.__getitem__)
        fractions.append(counts[token] / len(following))
        tokens.append(token)
        occurrences = [(s, p + 1) for chosen, s, p in following if chosen == token]
    return tokens, fractions, matched


def replay(pairs, r, rule: str, k: int = 16) -> float:
    drafter, guesser = SuffixDrafter(keep_corpus=True), SuffixDrafter(min_match=1, keep_corpus=True)
    table: dict = defaultdict(lambda: [1.0, 1.0])
    tokens_total = cost = 0.0
    for prompt, completion in pairs:
        row, guess_row, t = _Row(prompt, drafter.min_match), _Row(prompt, 1), 0
        while t < len(completion):
            tokens, fractions, matched = walk(drafter, row, k)
            truth = completion[t:]
            classes = [(min(3, int(math.log2(max(matched, 2))) - 1), f >= 1.0) for f in fractions]
            if rule == "rule":
                limit, score, length = min(k, matched), 1.0, 0
                for i, f in enumerate(fractions):
                    score *= f
                    if i >= limit or score < drafter.min_score:
                        break
                    length = i + 1
            elif rule == "oracle":
                length = next((i for i, x in enumerate(tokens) if i >= len(truth) or x != truth[i]), len(tokens))
            else:
                best, length, expected, reach = 1.0 / r[0], 0, 1.0, 1.0
                for i, c in enumerate(classes):
                    a, b = table[c]
                    reach *= a / (a + b)
                    expected += reach
                    if expected / r[i + 1] > best:
                        best, length = expected / r[i + 1], i + 1
            guessed = False
            if rule == "learned + guess" and length == 0 and r[1] <= r[0]:
                tokens, length = guesser.walk(guess_row, 1)
                guessed = length > 0
            length = min(length, len(truth) - 1)
            accepted = next((i for i in range(length) if tokens[i] != truth[i]), length)
            if not guessed:
                for i in range(min(accepted + 1, length)):
                    table[classes[i]][0 if i < accepted else 1] += 1
            row.extend(truth[: accepted + 1], drafter.min_match)
            guess_row.extend(truth[: accepted + 1], 1)
            t += accepted + 1
            tokens_total += accepted + 1
            cost += r[length]
        drafter.corpus.add(row)
        guesser.corpus.add(guess_row)
    return tokens_total / cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("--profile", help="a `bench --json` file with profile.r for this target (default: measure)")
    parser.add_argument("--prompts", default="benchmarks/resend.jsonl")
    parser.add_argument("--max-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    target, _ = load(args.target, "llamacpp")
    tokenizer = load_text_tokenizer(args.target, target)
    with open(args.prompts) as lines:
        prompts = [list(tokenizer.encode(json.loads(line)["prompt"]).ids) for line in lines][: args.max_prompts]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    pairs = [(p, generate_all(target, [p], params, None, k=0)[0]) for p in prompts]
    if args.profile:
        with open(args.profile) as found:
            r = json.load(found)["profile"]["r"]
    else:
        context = int(statistics.median(len(p) + len(c) // 2 for p, c in pairs))
        profile = profile_costs(target, k_max=16, context_length=context, repeats=9)
        r = [t / profile.target_s[0] for t in profile.target_s]
        print(f"r(1..17) at {profile.context_length} cells (median {context}): {' '.join(f'{x:.2f}' for x in r)}")
    for rule in ("rule", "learned", "learned + guess", "oracle"):
        print(f"{rule:>16}: {replay(pairs, r, rule):.2f} tokens per plain pass's cost")


if __name__ == "__main__":
    main()
