"""How many tokens per pass can any drafter that copies earlier text reach? A teacher-forced replay.

Prompt lookup and suffix drafting both propose text that followed an earlier occurrence of the row's last
tokens: in the row itself (prompt + output so far) or, for suffix drafting, in earlier requests. Under the
coupled rule the committed text does not depend on what was proposed (greedy, or seeded sampling with a
one-hot q), so a drafter's passes can be replayed over the target's own output: at text position t it
proposes k tokens, the pass commits the matching prefix and one more token, and the next pass starts there.

Replayed here, on the target's outputs for the prompts (requests in order, as `serve` would see them):
- verispec's prompt lookup (`--draft ngram`) and suffix drafting (`--draft suffix`, the corpus spanning the
  requests), through the same code `plan` uses;
- the copy oracle: at each pass, of every earlier occurrence of the row's last token (in the row or in an
  earlier request), the one whose continuation (a cycle when it runs into the row's end, as prompt lookup's)
  matches the most text. No drafter that copies after a match proposes more matching tokens in a pass; the
  oracle's tokens per pass over prompt lookup's bounds what choosing among occurrences can gain.

    python benchmarks/copy_bound.py [--prompts benchmarks/repeat.jsonl] [--max-prompts 12] [--k 16,32,64]
        [--temperature 0] [--out FILE.json]

Prints and writes tokens per pass and target positions per pass (proposals + 1) per drafter and k.
"""

from __future__ import annotations

import argparse
import json

from verispec.analysis.plan import _lookups
from verispec.assemble import Settings, load_target
from verispec.cli.common import read_prompts
from verispec.config import SamplingParams
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.drafters.suffix import SuffixDrafter
from verispec.engine import generate_all


def matched(proposal: list[int], text: list[int], t: int) -> int:
    """How many of the proposal's tokens the text at t starts with."""
    n = 0
    while n < len(proposal) and t + n < len(text) and proposal[n] == text[t + n]:
        n += 1
    return n


def continuation(source: list[int], at: int, history: list[int], k: int) -> list[int]:
    """k tokens of `source` from `at`; in the row's own history, the copy runs on into itself (a cycle)."""
    if source is not history:
        return source[at : at + k]
    period = len(history) - at
    return [history[at + i % period] for i in range(k)]


def oracle(history: list[int], earlier: list[list[int]], text: list[int], k: int) -> list[int]:
    """Of every earlier occurrence of history's last token, the continuation that matches `text` longest."""
    last, t, best = history[-1], len(history), []
    for source in [history, *earlier]:
        stop = len(source) - 1 if source is history else len(source)
        for at in range(1, stop + 1):
            if source[at - 1] == last and at < len(source) + (source is history):
                proposal = continuation(source, at, history, k)
                if matched(proposal, text, t) > matched(best, text, t):
                    best = proposal
    return best


def passes(text: list[int], start: int, propose) -> tuple[int, int]:
    """(passes, target positions) to commit text[start:] when `propose(t)` is the proposal at t."""
    t, count, positions = start, 0, 0
    while t < len(text):
        proposal = propose(t)
        count, positions, t = count + 1, positions + len(proposal) + 1, t + matched(proposal, text, t) + 1
    return count, positions


def replay(texts: list[list[int]], starts: list[int], k: int) -> dict[str, dict]:
    results = {}
    lookups = {
        "prompt lookup": _lookups(PromptLookupDrafter(), texts, starts, k),
        "suffix": SuffixDrafter(keep_corpus=True).replay(texts, starts, k),
    }
    for name, per_text in lookups.items():
        runs = []
        for text, start, (proposals, lengths) in zip(texts, starts, per_text):
            rows, sizes = proposals.tolist(), lengths.tolist()
            runs.append(passes(text, start, lambda t, s=start: rows[t - s][: sizes[t - s]]))
        results[name] = runs
    results["copy oracle"] = [
        passes(text, start, lambda t, i=i, text=text: oracle(text[:t], texts[:i], text, k))
        for i, (text, start) in enumerate(zip(texts, starts))
    ]
    tokens = sum(len(text) - start for text, start in zip(texts, starts))
    return {
        name: {
            "tokens_per_pass": tokens / sum(n for n, _ in runs),
            "positions_per_pass": sum(p for _, p in runs) / sum(n for n, _ in runs),
            "per_prompt_tokens_per_pass": [(len(x) - s) / n for x, s, (n, _) in zip(texts, starts, runs)],
        }
        for name, runs in results.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="benchmarks/repeat.jsonl")
    parser.add_argument("--max-prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", default="16,32,64")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out")
    args = parser.parse_args()
    target, tokenizer = load_target(Settings(draft="none"))
    texts, starts = [], []
    for i, prompt in enumerate(read_prompts(args.prompts, args.max_prompts)):
        ids = tokenizer.encode(prompt).ids
        params = SamplingParams(temperature=args.temperature, seed=i, max_new_tokens=args.max_new_tokens)
        texts.append(ids + generate_all(target, [ids], params, None, k=0)[0])
        starts.append(len(ids))
    report = {"prompts": args.prompts, "max_prompts": len(texts), "temperature": args.temperature, "by_k": {}}
    for k in (int(x) for x in args.k.split(",")):
        report["by_k"][k] = replay(texts, starts, k)
        for name, row in report["by_k"][k].items():
            print(
                f"k = {k:3d}  {name:14s} tokens per pass {row['tokens_per_pass']:6.2f}"
                f"  positions per pass {row['positions_per_pass']:6.2f}"
            )
        ratio = (
            report["by_k"][k]["copy oracle"]["tokens_per_pass"] / report["by_k"][k]["prompt lookup"]["tokens_per_pass"]
        )
        print(f"k = {k:3d}  copy oracle / prompt lookup, tokens per pass: {ratio:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
