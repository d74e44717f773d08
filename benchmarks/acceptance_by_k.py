"""Does acceptance at a draft position depend on the draft length? Greedy, the built-in pair on llama.cpp, batch 1.

Predicting tokens per pass at each k from acceptance per draft position (depth), pooled over whatever k ran,
leans toward long drafts. This measures, on the held-out prompts:
1. fixed k = 1, 3, 7: acceptance per depth and tokens per pass;
2. `--k auto`: tokens per pass at each k predicted from the run's passes by acceptance by depth (pooled over
   the k that ran), and by laying fixed-k passes over the text the run verified (a draft token at text position
   t matches the target's or not, whatever k is; a bonus position, never drafted, counts as the mean match
   rate), as the policy does (`policy.estimates.TextAcceptance`).

    python benchmarks/acceptance_by_k.py [--prompts 16] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from verispec.analysis.profile import batch_sizes, calibrate
from verispec.config import SamplingParams
from verispec.drafters.model import ModelDrafter
from verispec.engine import Batch
from verispec.llamacpp import GGUFTokenizer, LlamaCppModel
from verispec.models.gguf_convert import cached_gguf
from verispec.pair import DRAFT_DIR, TARGET_DIR
from verispec.policy import AdaptiveLength, FixedLength
from verispec.policy.estimates import TextAcceptance
from verispec.theory import capped_speedups


class Recorded:
    """Wraps a policy; keeps each pass's (k, betas at the verified positions)."""

    def __init__(self, policy):
        self.policy, self.k_max, self.passes = policy, policy.k_max, []

    def choose(self, batch: int = 1) -> int:
        return self.policy.choose(batch)

    def observe(self, k, beta_sums, verified, *args, **kwargs) -> None:
        self.passes.append((k, [round(b) for b in beta_sums[:k]]))
        self.policy.observe(k, beta_sums, verified, *args, **kwargs)


def decode(policy, target, draft, prompts, max_new_tokens: int) -> int:
    """Greedy decoding of the prompts in turn at one row; returns the passes run."""
    batch = Batch(target, [], [], ModelDrafter(draft), policy, capacity=1, max_length=1024)
    if isinstance(policy.policy, AdaptiveLength):
        calibrate(batch, policy.policy, batch_sizes(1), 1024 - 9)
    for i, prompt in enumerate(prompts):
        batch.join([prompt], [SamplingParams(temperature=0, max_new_tokens=max_new_tokens)], [i])
        while len(batch):
            batch.step()
    return len(policy.passes)


def by_depth(passes) -> list[float]:
    """Acceptance per depth: accepted / verified at each position."""
    accepted, verified = [0] * 8, [0] * 8
    for k, betas in passes:
        for i, b in enumerate(betas):
            verified[i] += 1
            accepted[i] += b
            if not b:
                break
    return [a / v for a, v in zip(accepted, verified) if v]


def text_matches(passes) -> list[float | None]:
    """Per text position: 1 where the draft's token matched, 0 where not, None where nothing was drafted."""
    text: list[float | None] = []
    for k, betas in passes:
        n = next((i for i, b in enumerate(betas) if not b), len(betas))
        text += betas[: n + 1] if n < len(betas) else betas + [None]
    return text


def laid_over_text(passes) -> list[float]:
    """Tokens per pass at k = 0..8 by fixed-k passes laid over the whole run's verified text: the policy's
    `TextAcceptance`, remembering every pass."""
    text = TextAcceptance(8, 0.7, memory=len(passes), horizon=len(passes))
    for at, (k, betas) in enumerate(passes):
        n = next((i for i, b in enumerate(betas) if not b), len(betas))
        text.add(at, {0: betas[: n + 1] if n < len(betas) else betas + [None]}, [1.0] * 8)
    return text.expected(len(passes), [1.0] * 9, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target, draft = LlamaCppModel(cached_gguf(TARGET_DIR, "f32")), LlamaCppModel(cached_gguf(DRAFT_DIR, "f32"))
    tokenizer = GGUFTokenizer(target)
    path = Path(__file__).with_name("heldout.jsonl")
    texts = [json.loads(line)["prompt"] for line in path.read_text().splitlines()][: args.prompts]
    prompts = [tokenizer.encode(t).ids for t in texts]
    for k in (1, 3, 7):
        policy = Recorded(FixedLength(k))
        passes = decode(policy, target, draft, prompts, args.max_new_tokens)
        text = text_matches(policy.passes)
        print(
            f"fixed k={k}: acceptance by depth {[round(a, 3) for a in by_depth(policy.passes)]}, "
            f"tokens/pass {len(text) / passes:.2f}"
        )
    auto = Recorded(AdaptiveLength(k_max=8))
    decode(auto, target, draft, prompts, args.max_new_tokens)
    depths = by_depth(auto.passes)
    depths += [depths[-1]] * (8 - len(depths))
    by_depths = capped_speedups(depths, [1.0] * 8, 0.0, [1.0] * 9, 8)[0]
    policy = auto.policy.estimates(1)[0]
    laid = laid_over_text(auto.passes)
    print(f"auto: acceptance by depth {[round(a, 3) for a in depths]}")
    for k in (1, 3, 5, 7):
        print(
            f"  k={k}: tokens/pass by depth {by_depths[k]:.2f}, by the verified text {laid[k]:.2f}, "
            f"by the policy (its last {auto.policy.settings.memory} passes) {policy[k]:.2f}"
        )


if __name__ == "__main__":
    main()
