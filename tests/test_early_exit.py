"""Self-speculative early exit: shared tensors, and exact like every other drafter."""

import itertools

import numpy as np
import pytest
import torch

from stats_helpers import assert_distributed_as
from verispec.config import SamplingParams
from verispec.drafters.early_exit import EarlyExitDrafter, early_exit_model
from verispec.engine import generate_all
from verispec.models.llama import LlamaConfig, LlamaForCausalLM, init_weights
from verispec.sampling import process_logits
from verispec.stats import SpecStats

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    config = LlamaConfig(vocab_size=6, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return init_weights(LlamaForCausalLM(config), std=0.5, seed=11).eval()


def test_the_draft_is_the_targets_own_layers(target):
    draft = early_exit_model(target, 2)
    assert draft.config.num_hidden_layers == 2
    shared = {p.data_ptr() for p in target.parameters()}
    assert all(p.data_ptr() in shared for p in draft.parameters())
    assert draft.lm_head.weight is target.lm_head.weight and draft.model.layers[1] is target.model.layers[1]
    for bad in (0, 4, 2.5):
        with pytest.raises(ValueError, match="num_layers"):
            early_exit_model(target, bad)


@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("k", [2, 4])
def test_greedy_output_is_identical_to_plain_decoding(target, layers, k):
    prompts = [[1, 2, 3], [5], [0, 4, 4, 2, 1]]
    params = SamplingParams(temperature=0, max_new_tokens=30)
    stats = SpecStats()
    assert generate_all(target, prompts, params, EarlyExitDrafter(target, layers), k=k, stats=stats) == generate_all(target, prompts, params)
    assert 0 < stats.accepted


def _exact_joint(target, prompt, params, tokens=3):
    """Exact distribution of the next `tokens` tokens under the processed target, by enumeration."""
    vocab = target.vocab_size
    probs = np.zeros((vocab,) * tokens)
    with torch.no_grad():
        for prefix in itertools.product(range(vocab), repeat=tokens - 1):
            rows = torch.tensor([prompt + list(prefix)])
            p = process_logits(target(rows)[0, len(prompt) - 1 :], params).double().numpy()  # [tokens, V]
            chain = np.prod([p[i, prefix[i]] for i in range(tokens - 1)])
            probs[prefix] = chain * p[tokens - 1]
    return probs


def test_joint_distribution_of_three_tokens_is_exact(target):
    """216 cells, N = 40,000 (a real model per row is slower than the Markov toys)."""
    prompt, n, setting = [2, 5, 1], 40_000, dict(temperature=0.7, top_k=4)
    params = SamplingParams(**setting, seed=21, max_new_tokens=3)
    stats = SpecStats()
    outputs = np.asarray(generate_all(target, [prompt] * n, params, EarlyExitDrafter(target, 2), k=3, stats=stats))
    cells = np.ravel_multi_index(outputs.T, (target.vocab_size,) * 3)
    counts = np.bincount(cells, minlength=target.vocab_size**3)
    assert_distributed_as(counts, _exact_joint(target, prompt, params).ravel(), are_counts=True, label=f"early exit {setting}")
    assert 0 < stats.accepted < stats.proposed
