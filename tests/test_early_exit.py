"""Self-speculative early exit: shared tensors and a shared KV cache. Its exactness (joint
distribution and greedy equality) is in test_exactness.py, with every other drafter."""

import pytest

from verispec.config import SamplingParams
from verispec.drafters.early_exit import EarlyExitDrafter, early_exit_model
from verispec.engine import generate_all
from verispec.models.llama import LlamaConfig, LlamaForCausalLM, init_weights
from verispec.stats import SpecStats

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_new_tokens=24)
GREEDY_PROMPTS = [[1, 2, 3], [4], [0, 4, 4, 2, 1, 3]]


def llama(layers: int, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=6,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return init_weights(LlamaForCausalLM(config), std=0.5, seed=seed).eval()


@pytest.fixture(scope="module")
def target():
    return llama(4, 11)


def test_the_draft_is_the_targets_own_layers(target):
    draft = early_exit_model(target, 2)
    assert draft.config.num_hidden_layers == 2 and target.config.num_hidden_layers == 4
    assert len(draft.model.layers) == 2 and len(target.model.layers) == 4
    shared = {p.data_ptr() for p in target.parameters()}
    assert all(p.data_ptr() in shared for p in draft.parameters())
    assert draft.lm_head.weight is target.lm_head.weight and draft.model.layers[1] is target.model.layers[1]
    for bad in (0, 4, 2.5, True):
        with pytest.raises(ValueError, match="early exit takes 1 to"):
            early_exit_model(target, bad)


def test_early_exit_shares_the_target_cache_and_proposes_as_with_its_own():
    """The shared-cache drafter allocates no KV of its own and, greedy, proposes exactly what
    an own-cache early exit proposes: the same acceptance counts."""
    target = llama(3, 21)  # odd sizes: not the fixture's
    drafter = EarlyExitDrafter(target, 2)
    shared, own = SpecStats(), SpecStats()
    out_shared = generate_all(target, GREEDY_PROMPTS, GREEDY, drafter, k=3, stats=shared)
    assert drafter.target_cache is not None and drafter.cache.keys.data_ptr() == drafter.target_cache.keys.data_ptr()

    class OwnCache(EarlyExitDrafter):
        shares_target_cache = False

    out_own = generate_all(target, GREEDY_PROMPTS, GREEDY, OwnCache(target, 2), k=3, stats=own)
    assert out_shared == out_own
    assert shared.accepted_by_position == own.accepted_by_position and 0 < shared.accepted < shared.proposed
