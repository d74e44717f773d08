"""Writes tests/data/greedy_draft_matches.json: for each held-out prompt (benchmarks/heldout.jsonl), the built-in
target's greedy continuation (72 tokens, torch) and, at each generated position, whether the built-in draft's argmax
on the true prefix equals the target's token. At temperature 0 this decides how many tokens any draft length accepts
from any position, so a draft-length policy can be replayed on it (tests/policy_sim.py `replay`).
Run from the repository root: python tests/data/make_greedy_draft_matches.py"""

import json

import torch

from verispec import assemble

parts = assemble.load_parts(assemble.Settings(k="auto", backend="torch"))
target, draft = parts.target, parts.drafter.model
matches = []
with torch.no_grad():
    for line in open("benchmarks/heldout.jsonl"):
        ids = parts.tokenizer.encode(json.loads(line)["prompt"]).ids
        start = len(ids)
        cache = target.new_cache(1, start + 80)
        logits = target(torch.tensor([ids]), cache)
        for _ in range(72):
            ids.append(int(logits[0, -1].argmax()))
            logits = target(torch.tensor([ids[-1:]]), cache)
        guesses = draft(torch.tensor([ids]))[0].argmax(-1).tolist()  # guesses[i]: the draft's token after ids[: i + 1]
        matches.append("".join(str(int(guesses[i - 1] == ids[i])) for i in range(start, len(ids))))
about = (
    "the built-in pair (torch), greedy, 72 new tokens per held-out prompt: "
    "1 where the draft's argmax on the true prefix is the target's token"
)
with open("tests/data/greedy_draft_matches.json", "w") as f:
    json.dump({"about": about, "matches": matches}, f, indent=0)
