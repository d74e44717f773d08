"""The built-in target/draft pair: Hugging Face directories shipped inside the package.

Owns nothing but their locations. `verispec generate` uses them when no --target is given;
MODEL_CARD.md says how they were trained and what they measure;
`benchmarks/train_pair.sh` reproduces them.
"""

from pathlib import Path

TARGET_DIR = Path(__file__).parent / "target"  # 56.6M-parameter Llama, bfloat16 weights
DRAFT_DIR = Path(__file__).parent / "draft"  # 3.7M-parameter Llama distilled from the target
HELDOUT_PROMPTS = (
    Path(__file__).parent / "heldout.jsonl"
)  # benchmarks/heldout.jsonl: function openings of the held-out split
