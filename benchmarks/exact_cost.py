"""What exact kernels cost, per GGUF type: verispec with --exact-kernels on and off, and llama.cpp plain.

For each type of the built-in target (quantized by llama.cpp's own quantizer into --dir, as
target-TYPE.gguf; the built-in draft in f32), three child processes per round, interleaved:
verispec with exact kernels on, with them off (llama.cpp's default kernels), and llama-cpp-python's
`Llama` (llama.cpp's own plain greedy decoding, its default settings but 2 threads). The verispec
children time target passes of 1..5 positions at a context of 128 (t(1), r(n) = t(n)/t(1), median
of 20) and decode the prompts plainly and speculatively (the built-in draft, greedy, k = 3);
all three report decode tokens/s. Medians over rounds; ratios are within one round's children.

    python benchmarks/exact_cost.py --dir runs/exact --types f32,F16,Q8_0,Q4_0,Q4_1,Q4_K_M,Q5_K_M,Q6_K --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

VERISPEC = r"""
import json, statistics, sys, time, torch
from verispec import llamacpp
llamacpp.set_exact_kernels(sys.argv[1] == "on")
from verispec import ModelDrafter, SamplingParams, generate_all
from verispec.llamacpp import LlamaCppModel
target, draft = LlamaCppModel(sys.argv[2]), LlamaCppModel(sys.argv[3])
draft.shape_invariant = False
prompts, new = json.loads(sys.argv[4]), int(sys.argv[5])
ids = [(7919 * i + 13) % target.vocab_size for i in range(1, 140)]
t = {}
for n in range(1, 6):
    cache = target.new_cache(1, 160); target.prefill([ids[:128]], cache)
    times = []
    for _ in range(21):
        cache.rollback([128])
        start = time.perf_counter()
        target(torch.tensor([ids[128 : 128 + n]]), cache)
        times.append(time.perf_counter() - start)
    t[n] = statistics.median(times[1:])
params = SamplingParams(temperature=0, max_new_tokens=new)
out = {"t1_ms": 1e3 * t[1], "r": {n: t[n] / t[1] for n in range(2, 6)}}
for name, drafter, k in (("plain", None, 0), ("spec", "draft", 3)):
    warm = SamplingParams(temperature=0, max_new_tokens=8)
    generate_all(target, [prompts[0]], warm, ModelDrafter(draft) if drafter else None, k=k)
    start, count = time.perf_counter(), 0
    for p in prompts:
        count += len(generate_all(target, [p], params, ModelDrafter(draft) if drafter else None, k=k)[0])
    out[name + "_tok_s"] = count / (time.perf_counter() - start)
print(json.dumps(out))
"""

PEER = r"""
import json, sys, time
from verispec.llamacpp.lib import library
library()  # the same library state as verispec's (on a CPU with AMX: no AMX buffers, which crash there)
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)
prompts, new = json.loads(sys.argv[2]), int(sys.argv[3])
def run(prompt, n):
    got = 0
    for token in llm.generate(prompt, temp=0.0, reset=True):
        got += 1
        if got == n:
            break
    llm.reset()
    return got
run(prompts[0], 8)
start, count = time.perf_counter(), 0
for p in prompts:
    count += run(p, new)
print(json.dumps({"plain_tok_s": count / (time.perf_counter() - start)}))
"""


def child(argv: list[str], timeout: float) -> dict:
    done = subprocess.run([sys.executable, "-c", *argv], capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dir", required=True, help="holds target-TYPE.gguf for each type (made with verispec convert)"
    )
    parser.add_argument("--types", default="f32,F16,Q8_0,Q4_0,Q4_1,Q4_K_M,Q5_K_M,Q6_K")
    parser.add_argument("--prompts", default=str(Path(__file__).parent / "heldout.jsonl"))
    parser.add_argument("--max-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from verispec.llamacpp import GGUFTokenizer, LlamaCppModel
    from verispec.models.gguf_convert import cached_gguf
    from verispec.pair import DRAFT_DIR

    draft = str(cached_gguf(DRAFT_DIR, "f32"))
    texts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()][
        : args.max_prompts
    ]
    report = {}
    for name in args.types.split(","):
        path = str(Path(args.dir) / f"target-{name}.gguf")
        prompts = json.dumps([GGUFTokenizer(LlamaCppModel(path, n_threads=1)).encode(t).ids for t in texts])
        rounds = []
        for _ in range(args.rounds):
            rounds.append(
                {
                    "on": child([VERISPEC, "on", path, draft, prompts, str(args.max_new_tokens)], 600),
                    "off": child([VERISPEC, "off", path, draft, prompts, str(args.max_new_tokens)], 600),
                    "llama.cpp": child([PEER, path, prompts, str(args.max_new_tokens)], 600),
                }
            )
        report[name] = rounds
        print(f"{name}: " + json.dumps(summary(rounds)), file=sys.stderr, flush=True)
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def _median(rounds: list[dict], f) -> float:
    values = [f(r) for r in rounds if not any("error" in v for v in r.values())]
    return statistics.median(values) if values else float("nan")


def summary(rounds: list[dict]) -> dict:
    return {
        "t1_on_ms": _median(rounds, lambda r: r["on"]["t1_ms"]),
        "t1_off_ms": _median(rounds, lambda r: r["off"]["t1_ms"]),
        "r_on": [round(_median(rounds, lambda r, n=n: r["on"]["r"][str(n)]), 2) for n in range(2, 6)],
        "r_off": [round(_median(rounds, lambda r, n=n: r["off"]["r"][str(n)]), 2) for n in range(2, 6)],
        "plain_on_over_off": _median(rounds, lambda r: r["on"]["plain_tok_s"] / r["off"]["plain_tok_s"]),
        "spec_on_over_off": _median(rounds, lambda r: r["on"]["spec_tok_s"] / r["off"]["spec_tok_s"]),
        "spec_on_over_llama_plain": _median(rounds, lambda r: r["on"]["spec_tok_s"] / r["llama.cpp"]["plain_tok_s"]),
        "spec_off_over_llama_plain": _median(rounds, lambda r: r["off"]["spec_tok_s"] / r["llama.cpp"]["plain_tok_s"]),
        "plain_on_over_llama_plain": _median(rounds, lambda r: r["on"]["plain_tok_s"] / r["llama.cpp"]["plain_tok_s"]),
    }


def table(report: dict) -> str:
    lines = [
        "| type | t(1) ms on / off | r(2..5) on | r(2..5) off | plain on/off | spec on/off | spec on / llama.cpp plain "
        "| spec off / llama.cpp plain | plain on / llama.cpp plain |",
        "|---" * 9 + "|",
    ]
    for name, rounds in report.items():
        s = summary(rounds)
        lines.append(
            f"| {name} | {s['t1_on_ms']:.1f} / {s['t1_off_ms']:.1f} | {', '.join(map(str, s['r_on']))} | "
            f"{', '.join(map(str, s['r_off']))} | {s['plain_on_over_off']:.2f} | {s['spec_on_over_off']:.2f} | "
            f"{s['spec_on_over_llama_plain']:.2f} | {s['spec_off_over_llama_plain']:.2f} | "
            f"{s['plain_on_over_llama_plain']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
