"""Greedy speculative decoding against plain decoding on every GGUF type of the built-in target.

For each type (the built-in target converted to f32 and quantized by llama.cpp's own quantizer),
the held-out prompts are decoded greedily with no draft, then with the built-in draft (f32) and
with prompt lookup at k = 1, 2, 4 and auto; every speculative row must equal the plain row token
for token. It also decodes each prompt with llama-cpp-python's `Llama` (llama.cpp's own plain
decoding, its default settings) and reports whether verispec's plain rows equal those.

    python benchmarks/exact_types.py --types f32,F16,Q8_0,Q4_0,Q4_1,Q4_K_M,Q5_K_M,Q6_K --out runs/exact
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from verispec import AdaptiveLength, ModelDrafter, PromptLookupDrafter, SamplingParams, generate_all
from verispec.llamacpp import GGUFTokenizer, LlamaCppModel, exact_kernels, set_exact_kernels
from verispec.llamacpp.quantize import quantize
from verispec.models.gguf_convert import cached_gguf
from verispec.pair import DRAFT_DIR, TARGET_DIR


def llama_cpp_plain(path: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=512, verbose=False)
    rows = []
    for prompt in prompts:
        row = []
        for token in llm.generate(prompt, temp=0.0, reset=True):
            row.append(int(token))
            if len(row) == new:
                break
        llm.reset()
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", default="f32,F16,Q8_0,Q4_0,Q4_1,Q4_K_M,Q5_K_M,Q6_K")
    parser.add_argument("--prompts", default=str(Path(__file__).parent / "heldout.jsonl"))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="runs/exact")
    parser.add_argument("--exact-kernels", choices=["on", "off"], default="on")
    args = parser.parse_args()
    set_exact_kernels(args.exact_kernels == "on")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    f32 = cached_gguf(TARGET_DIR, "f32")
    draft = LlamaCppModel(cached_gguf(DRAFT_DIR, "f32"))
    draft.shape_invariant = False
    texts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    params = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
    report = []
    for name in args.types.split(","):
        path = f32 if name.lower() == "f32" else out / f"target-{name}.gguf"
        if not path.is_file():
            quantize(f32, path, name)
        target = LlamaCppModel(path)
        prompts = [GGUFTokenizer(target).encode(t).ids for t in texts]
        started = time.perf_counter()
        plain = [generate_all(target, [p], params, None, k=0)[0] for p in prompts]
        differing = {}
        for drafter_name in ("draft", "ngram"):
            for k in (1, 2, 4, "auto"):
                for i, prompt in enumerate(prompts):
                    drafter = ModelDrafter(draft) if drafter_name == "draft" else PromptLookupDrafter()
                    policy = AdaptiveLength() if k == "auto" else k
                    row = generate_all(target, [prompt], params, drafter, k=policy)[0]
                    if row != plain[i]:
                        first = next(
                            (j for j, (a, b) in enumerate(zip(row, plain[i])) if a != b), min(len(row), len(plain[i]))
                        )
                        differing.setdefault(f"{drafter_name} k={k}", []).append((i, first))
        batched = generate_all(target, prompts, params, ModelDrafter(draft), k=4)
        batch_differs = [i for i, (a, b) in enumerate(zip(batched, plain)) if a != b]
        peer = llama_cpp_plain(path, prompts, args.max_new_tokens)
        peer_differs = [i for i, (a, b) in enumerate(zip(peer, plain)) if a != b]
        line = {
            "type": name,
            "prompts": len(prompts),
            "exact_kernels": exact_kernels(),
            "flash_attention": target.flash_attention,  # the regime it ran (--flash-attn auto: llamacpp/regime.py)
            "speculative_differs": differing,
            "batched_k4_differs": batch_differs,
            "llama_cpp_plain_differs": peer_differs,
            "seconds": round(time.perf_counter() - started, 1),
        }
        report.append(line)
        print(json.dumps(line), flush=True)
    (out / f"exact-types-{args.exact_kernels}.json").write_text(json.dumps(report, indent=1))
    return 0 if all(not r["speculative_differs"] and not r["batched_k4_differs"] for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
