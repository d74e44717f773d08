"""`SplitLength` (`verispec.policy.split`): `--k auto` for a combined draft, an AdaptiveLength per kind of pass.

- On a simulated machine where passes by lookup alone cost no draft time and accept 0.95 a position while the
  model's passes cost 1 s a token and accept 0.5, the lookup's arm goes long and the model's arm goes plain, and
  the throughput beats one policy measuring both kinds at once (the negative control: it chooses one k for both,
  its estimates pooled, stays near plain), by more than 15%.
- Routing: each arm sees only its own passes, both see plain passes, and `split_for` wraps only an
  AdaptiveLength meeting a drafter with `alone_k` and `kind`.
- Through the engine: greedy output with a combined draft under SplitLength equals plain output, and with a lookup
  that is always right every pass drafts by lookup alone, as far as the lookup's arm allows.
"""

from __future__ import annotations

import random

import pytest
from test_combined import GREEDY_LONG, _Scripted
from test_engine import PROMPTS_1, tiny_llama

from verispec.drafters.combined import CombinedDrafter
from verispec.drafters.model import ModelDrafter
from verispec.engine import generate_all
from verispec.policy import AdaptiveLength, FixedLength, SplitLength, split_for
from verispec.stats import SpecStats

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py

LOOKUP_ALPHA, MODEL_ALPHA, DRAFT_S = 0.95, 0.5, 1.0  # per position; the model's seconds per proposed token
PRIOR_R = tuple(1.0 + 0.1 * n for n in range(17))  # a target pass of n + 1 positions costs 1 + 0.1 n seconds


class _Kinds:
    """A stand-in for CombinedDrafter's two attributes the policy reads and writes."""

    alone_k: int | None = None
    kind = "plain"


def _simulate(split: bool, passes: int = 3000, seed: int = 0) -> tuple[float, AdaptiveLength, _Kinds]:
    """Half the passes (at random: the gate's choice, independent of k) go by lookup alone, half by the model. A
    target pass of n positions costs 1 + 0.1 (n - 1) seconds, which the policy knows from the start (as from a
    calibration). Returns (tokens per second, the model's policy, the drafter)."""
    rng, drafter, model = random.Random(seed), _Kinds(), AdaptiveLength(k_max=8, prior_c=DRAFT_S, prior_r=PRIOR_R)
    policy = SplitLength(model, drafter) if split else model
    tokens = seconds = 0.0
    for _ in range(passes):
        k = policy.choose(1)
        lookup = rng.random() < 0.5
        allowed = (drafter.alone_k if drafter.alone_k is not None else k) if lookup else k
        alpha, draft_s = (LOOKUP_ALPHA, 0.0) if lookup else (MODEL_ALPHA, DRAFT_S * allowed)
        drafter.kind = "plain" if allowed == 0 else "lookup" if lookup else "model"
        accepted = 0
        while accepted < allowed and rng.random() < alpha:
            accepted += 1
        betas = [1.0] * accepted + [0.0] * (accepted < allowed)
        target_s = 1.0 + 0.1 * allowed
        policy.observe(allowed, betas, [1] * len(betas), draft_s, target_s, 1, k, 0.0, accepted + 1)
        tokens, seconds = tokens + accepted + 1, seconds + draft_s + target_s
    return tokens / seconds, model, drafter


def test_each_arm_chooses_for_its_own_passes_and_the_split_beats_one_pooled_policy():
    split_tps, model, drafter = _simulate(split=True)
    assert model.lookup_arm().choose(1) >= 6  # the lookup: free, 0.95 a position
    assert model.choose(1) == 0  # the model: 0.5 a position at 1 s a token never pays
    pooled_tps, _, _ = _simulate(split=False)
    assert split_tps > 1.15 * pooled_tps, (split_tps, pooled_tps)


def test_negative_control_one_policy_for_both_kinds_chooses_a_length_wrong_for_one():
    _, pooled, _ = _simulate(split=False)
    assert pooled.choose(1) <= 1  # the model's passes pull it to plain: far too short for the lookup's


def test_each_arm_sees_only_its_own_passes_and_both_see_plain_ones():
    drafter, model = _Kinds(), AdaptiveLength(k_max=4)
    policy = SplitLength(model, drafter)
    for kind, passes in (("lookup", 3), ("model", 2), ("plain", 4)):
        for _ in range(passes):
            policy.choose(1)
            drafter.kind = kind
            k = 0 if kind == "plain" else 2
            policy.observe(k, [1.0, 1.0][:k], [1, 1][:k], 0.01, 0.1, 1, 2, 0.0, k + 1)
    assert (model.lookup_arm().passes, model.passes) == (3 + 4, 2 + 4)


def test_split_for_wraps_only_auto_with_a_combined_draft():
    auto, fixed = AdaptiveLength(k_max=4), FixedLength(3)
    assert isinstance(split_for(auto, _Kinds()), SplitLength)
    assert split_for(auto, object()) is auto and split_for(fixed, _Kinds()) is fixed
    assert split_for(auto, _Kinds()).lookup is split_for(auto, _Kinds()).lookup  # kept on the model's policy


@pytest.mark.parametrize("offset", [0, 1])
def test_greedy_output_under_the_split_equals_plain(offset):
    """offset 0: a lookup always right, so every pass goes by lookup alone at the lookup's arm's length; 1: its
    first token always wrong, so after two misses the model drafts at the model's arm's length."""
    target, draft = tiny_llama(0), tiny_llama(0, noise=0.02)
    plain = generate_all(target, PROMPTS_1, GREEDY_LONG)
    stats, policy = SpecStats(), AdaptiveLength(k_max=4)
    drafter = CombinedDrafter(_Scripted(plain[0], offset, target.config.vocab_size), ModelDrafter(draft))
    assert generate_all(target, PROMPTS_1, GREEDY_LONG, drafter, k=policy, stats=stats) == plain
    arm = policy.lookup_arm()
    if offset == 0:
        assert drafter.lookup_passes == arm.passes - (stats.target_passes - drafter.lookup_passes) > 0
        assert policy.passes == stats.target_passes - drafter.lookup_passes  # the model's arm: plain passes only
    else:
        assert drafter.lookup_passes == 2 and policy.passes >= stats.target_passes - 2
