"""The exactness checks CI cannot run: the torch engine and its continuous batcher on a CUDA device.

CI has no GPU; run this where one is lent, from the repository root:

    python benchmarks/gpu_check.py [--device cuda] [--n 20000]

It reuses the CPU tests' toy Llama models (tests/test_exactness.py) and churn driver
(tests/test_batch.py), with every model on --device:
1. exactness under churn: PROMPT requests join a batch of 48 rows at random passes beside
   background requests with other settings, some cancelled; the 3-token continuations of n
   completed ones (temperature 0.8, top-k 4, model draft, k = 3) against the exact joint
   distribution enumerated from the same weights on the CPU (chi-square at a 1e-9 false-failure
   rate, tests/stats_helpers.py);
2. its negative control: a join that pends the wrong token must fail that test;
3. no cross-talk: 32 greedy rows with a draft (k = 3) in one batch give each row's plain greedy
   tokens decoded alone.
Prints one line per check and exits 1 if any fails. It needs none of the built-in pair's weights.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from stats_helpers import is_distributed_as  # noqa: E402
from test_batch import PendsTheWrongToken, churn  # noqa: E402
from test_exactness import SETTING, VOCAB, _exact_joint, llama  # noqa: E402

from verispec.config import SamplingParams  # noqa: E402
from verispec.drafters.model import ModelDrafter  # noqa: E402
from verispec.engine import generate_all  # noqa: E402


class PendsTheWrongTokenOnDevice(PendsTheWrongToken):
    """tests/test_batch.py's planted bug, its pending tokens kept on the batch's device."""

    def join(self, prompts, params, ids):
        super().join(prompts, params, ids)
        self.pending = self.pending.to(self.device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--n", type=int, default=20_000, help="completed PROMPT requests in the churn test")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device} ({name}), torch {torch.__version__}", flush=True)
    exact = _exact_joint(llama(2, 11), SamplingParams(**SETTING))  # on the CPU
    target, draft = llama(2, 11).to(device), llama(1, 12).to(device)
    failed = 0

    started = time.perf_counter()
    counts = churn(target, ModelDrafter(draft), args.n, seed=700)
    ok = is_distributed_as(counts, exact, are_counts=True)
    failed += not ok
    print(
        f"churn, model draft, k=3, {args.n} requests: {'exact' if ok else 'NOT EXACT'} "
        f"({time.perf_counter() - started:.0f} s)",
        flush=True,
    )

    started = time.perf_counter()
    counts = churn(target, ModelDrafter(draft), max(args.n // 3, 2000), seed=790, batch_cls=PendsTheWrongTokenOnDevice)
    caught = not is_distributed_as(counts, exact, are_counts=True)
    failed += not caught
    print(
        "negative control (a join pends the wrong token): "
        f"{'fails, as it must' if caught else 'PASSES: the test sees nothing'}"
        f" ({time.perf_counter() - started:.0f} s)",
        flush=True,
    )

    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))] for _ in range(32)]
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    batched = generate_all(target, prompts, greedy, ModelDrafter(draft), k=3)
    alone = [generate_all(target, [prompt], greedy, drafter=None)[0] for prompt in prompts]
    same = sum(a == b for a, b in zip(batched, alone))
    failed += same != len(prompts)
    print(
        f"greedy, 32 rows with a draft in one batch against each alone and plain: {same}/{len(prompts)} identical",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
