"""The built-in pair shipped in the package: it loads with verispec and with transformers, and
verispec's greedy continuation of a held-out prompt equals transformers' (float32)."""

import pytest
import torch

from verispec import SamplingParams, generate_all
from verispec.cli import main
from verispec.drafters.model import ModelDrafter
from verispec.models.checkpoint import load_pretrained, load_tokenizer
from verispec.pair import DRAFT_DIR, TARGET_DIR
from verispec.training.data import read_text, split_corpus
from verispec.training.train import held_out_loss

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def held_out_prompt() -> list[int]:
    """The first 64 tokens of the first held-out standard-library file (never trained on)."""
    tokenizer = load_tokenizer(TARGET_DIR)
    _, held_out = split_corpus()
    return tokenizer.encode(read_text(held_out[0])).ids[:64]


@pytest.fixture(scope="module")
def target():
    return load_pretrained(TARGET_DIR)


def test_greedy_continuation_equals_transformers(target, held_out_prompt):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(TARGET_DIR, torch_dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(TARGET_DIR)
    assert tokenizer.encode(tokenizer.decode(held_out_prompt)) == held_out_prompt
    ids = torch.tensor([held_out_prompt])
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[
            0, len(held_out_prompt) :
        ].tolist()
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, stop_token_ids=(0,))  # both stop at <|endoftext|>
    plain = generate_all(target, [held_out_prompt], params)
    speculative = generate_all(target, [held_out_prompt], params, ModelDrafter(load_pretrained(DRAFT_DIR)), k=2)
    assert plain[0] == expected
    assert speculative[0] == expected


def test_target_is_clearly_better_than_the_draft_on_held_out_text(target, tmp_path):
    """Held-out cross-entropy (nats/token) on the running interpreter's held-out files."""
    from verispec.training.data import tokenize_files

    tokenizer = load_tokenizer(TARGET_DIR)
    _, held_out = split_corpus()
    data = tmp_path
    tokenize_files(tokenizer, held_out[:20]).tofile(data / "heldout.bin")
    target_loss = held_out_loss(target, data, max_windows=16)
    draft_loss = held_out_loss(load_pretrained(DRAFT_DIR), data, max_windows=16)
    assert target_loss < 2.6 and draft_loss > target_loss + 0.1  # random weights: ln(8192) = 9.0


def test_the_main_command_needs_no_model_arguments(capsys):
    assert main(["generate", "def quicksort(arr):", "--max-new-tokens", "24", "--ignore-eos"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("def quicksort(arr):") and len("\n".join(out[:-1])) > len("def quicksort(arr):")
    assert out[-1].startswith("24 tokens in") and "alpha_hat" in out[-1] and "estimated speed-up ~" in out[-1]
    assert main(["generate", "def quicksort(arr):", "--max-new-tokens", "8", "--k", "3"]) == 0  # a fixed k: one too
    assert "estimated speed-up ~" in capsys.readouterr().out.splitlines()[-1]
