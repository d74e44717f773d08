"""Write benchmarks/repeat.jsonl: an agentic editing workload whose outputs repeat across requests.

An agent edits one function over several turns, its context growing with its own earlier
outputs, as a coding assistant's tool loop does. Made from the held-out split of the corpus
(`verispec.training.data.split_corpus`: files the built-in pair never trained on). A session
takes one held-out function and applies small edits one after another (a local name renamed, a
comment line added, a number changed). Turn 0's prompt is the function, then the marker
'# The same function, edited.' and the first lines of its next version; turn j's prompt is turn
j-1's prompt, the built-in target's greedy output for it (whole lines), the marker again and the
first lines of the version after j+1 edits. The built-in model is no instruction follower and
copies held-out text poorly, but it repeats its own text: turn j's output mostly re-emits turn
j-1's, which is in its prompt and among the earlier requests' outputs. Sessions follow one
another, turns in order, so a drafter that remembers earlier requests sees them in turn.

With `--resend` it writes benchmarks/resend.jsonl instead: a stateless tool loop that re-sends the
function's current version each turn, not the conversation (turn j's prompt is version j, the
marker and the first lines of version j+1). Turn j's output then re-emits turn j-1's, which is
among the earlier requests' outputs but not in its prompt: what suffix drafting's corpus adds to
prompt lookup.

Usage: python benchmarks/make_repeat_workload.py [--resend]   (runs the built-in target, llama.cpp
when installed; a few minutes on 2 cores). Deterministic for a given interpreter's standard library
and model weights. It prints, per request and overall, the share of the greedy output's 8-grams
(MAX_NEW_TOKENS tokens) that occurred in earlier requests' prompts or outputs, and the share in
the request's own prompt.
"""

from __future__ import annotations

import ast
import json
import keyword
import random
import re
from pathlib import Path

from make_prompts import functions

from verispec.training.data import read_text, split_corpus

SESSIONS, TURNS, SEED, MAX_NEW_TOKENS = 8, 4, 0, 128  # 8 sessions x 4 turns = 32 requests
MARKER = "# The same function, edited."
COMMENTS = ("# checked again", "# keep this in sync with the caller", "# see the note above")
HEAD_LINES = 2  # the lines of the next version that open each turn


def local_names(text: str) -> list[str]:
    """Names assigned or passed as arguments inside the function, used at least twice, longest first."""
    try:
        tree = ast.parse(text)
    except SyntaxError:  # dedented text with a multi-line string
        return []
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    names |= {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg) and a.arg not in ("self", "cls")}
    used = [n for n in names if not keyword.iskeyword(n) and len(re.findall(rf"\b{n}\b", text)) >= 2]
    return sorted(used, key=lambda n: (-len(n), n))


def edit(text: str, step: int, rng: random.Random) -> str:
    """One small edit: rename a local name, add a comment line, or change a number (cycling)."""
    lines = text.splitlines()
    if step % 3 == 0 and (names := local_names(text)):
        name = names[0]
        return re.sub(rf"\b{name}\b", f"{name}_{step + 1}", text)
    if step % 3 == 2 and (numbers := [i for i, line in enumerate(lines) if re.search(r"\b\d+\b", line)]):
        i = rng.choice(numbers)
        lines[i] = re.sub(r"\b(\d+)\b", lambda m: str(int(m.group(1)) + 1), lines[i], count=1)
        return "\n".join(lines)
    i = rng.randrange(1, len(lines))
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    return "\n".join(lines[:i] + [indent + COMMENTS[step % len(COMMENTS)]] + lines[i:])


def whole_lines(text: str) -> str:
    """`text` up to its last line end, without it (a prompt ends at a line end, as make_prompts.py explains)."""
    return text[: text.rfind("\n")].rstrip() if "\n" in text else ""


def session(text: str, rng: random.Random, decode, resend: bool = False) -> tuple[list[str], list[str]]:
    """The prompts of one function's editing session, and the greedy outputs (texts) for them; with
    `resend` each prompt holds the function's current version, not the conversation so far."""
    versions = [text]
    for step in range(TURNS):
        versions.append(edit(versions[-1], step, rng))
    prompts, outputs = [], []
    context = text
    for j in range(TURNS):
        head = "\n".join(versions[j + 1].splitlines()[:HEAD_LINES])
        prompts.append(f"{context}\n\n\n{MARKER}\n{head}")
        outputs.append(decode(prompts[-1]))
        context = versions[j + 1] if resend else prompts[-1] + whole_lines(outputs[-1])
    return prompts, outputs


def candidates() -> list[str]:
    """Held-out functions of 10 to 30 lines that parse on their own, shuffled with SEED."""
    _, held = split_corpus()
    found = []
    for path in held:
        for name, text in functions(read_text(path)):
            lines = text.splitlines()
            if 6 <= len(lines) <= 20 and len(text) < 700 and not name.startswith("_") and local_names(text):
                found.append(text)
    random.Random(SEED).shuffle(found)
    return found


def repeated_share(outputs: list[list[int]], prompts: list[list[int]], n: int = 8) -> list[tuple[float, float]]:
    """Per request: (share of its output's n-grams seen in earlier prompts or outputs, share in its own prompt)."""

    def grams(tokens: list[int]) -> set[tuple[int, ...]]:
        return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}

    seen: set[tuple[int, ...]] = set()
    shares = []
    for prompt, output in zip(prompts, outputs):
        own = [tuple(output[i : i + n]) for i in range(len(output) - n + 1)]
        in_prompt = grams(prompt)
        shares.append(
            (sum(g in seen for g in own) / max(1, len(own)), sum(g in in_prompt for g in own) / max(1, len(own)))
        )
        seen |= grams(prompt) | grams(output)
    return shares


def main() -> None:
    import sys

    from verispec import assemble
    from verispec.config import SamplingParams
    from verispec.engine import generate_all

    target, tokenizer = assemble.load_target(assemble.Settings())
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)

    def decode(prompt: str) -> str:
        tokens = generate_all(target, [tokenizer.encode(prompt).ids], params)[0]
        return tokenizer.decode(tokens[: tokens.index(0)] if 0 in tokens else tokens)  # 0: <|endoftext|>

    rng = random.Random(SEED)
    prompts, outputs = [], []
    for text in candidates()[:SESSIONS]:
        more = session(text, rng, decode, resend="--resend" in sys.argv[1:])
        prompts += more[0]
        outputs += more[1]
    out = Path(__file__).parent / ("resend.jsonl" if "--resend" in sys.argv[1:] else "repeat.jsonl")
    out.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in prompts))
    print(f"wrote {out}: {len(prompts)} prompts, {SESSIONS} sessions of {TURNS} turns")
    encode = [tokenizer.encode(t).ids for t in prompts], [tokenizer.encode(t).ids for t in outputs]
    shares = repeated_share(encode[1], encode[0])
    for i, (earlier, own) in enumerate(shares):
        print(f"request {i:2d} (turn {i % TURNS}): 8-grams seen earlier {earlier:.0%}, in its prompt {own:.0%}")
    later = [s[0] for i, s in enumerate(shares) if i % TURNS]
    print(
        f"mean share of output 8-grams seen in earlier requests: {sum(s[0] for s in shares) / len(shares):.0%} "
        f"(turns 1-{TURNS - 1}: {sum(later) / len(later):.0%}); in the request's own prompt: "
        f"{sum(s[1] for s in shares) / len(shares):.0%}"
    )


if __name__ == "__main__":
    main()
