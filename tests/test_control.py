"""Draft-length policies: they change how many tokens are proposed, never which are committed.

Exactness: scripted and adaptive draft lengths (k = 0 steps included, so the draft model's
pending tokens pile up and are caught up in one pass) keep the joint distribution of a
3-token continuation exact, and greedy output identical to plain decoding. Behaviour: the
adaptive policy speculates when the refined model says it pays, and backs off to k = 0 when
acceptance is low, the draft is expensive, or verification is compute-bound.
"""

from __future__ import annotations

import random

import pytest

from stats_helpers import assert_distributed_as
from test_engine import JOINT_N, JOINT_PROMPT, JOINT_TOKENS, _joint_counts
from verispec.config import SamplingParams
from verispec.policy import AdaptiveLength, FixedLength, _draft_time
from verispec.drafters.model import ModelDrafter
from verispec.engine import generate_all
from verispec.models.llama import LlamaConfig, LlamaForCausalLM, init_weights
from verispec.stats import SpecStats
from verispec.theory import speedup


def near_best_k(alpha: float, c: float, k_max: int, tolerance: float = AdaptiveLength.tolerance) -> int:
    """The closed form's choice under AdaptiveLength's rule: the smallest k whose S(k) = E / (1 + kc)
    is within `tolerance` of the best over 0..k_max (tolerance 0: the argmax, theory.optimal_k)."""
    s = [speedup(alpha, k, c) for k in range(k_max + 1)]
    return next(k for k, value in enumerate(s) if value >= (1 - tolerance) * max(s))


class Scripted:
    """A policy that plays a fixed sequence of draft lengths, then repeats the last."""

    def __init__(self, ks: list[int]):
        self.ks, self.k_max, self.step = ks, max(ks), 0

    def choose(self, batch: int = 1) -> int:
        k = self.ks[min(self.step, len(self.ks) - 1)]
        self.step += 1
        return k

    def observe(self, *args, **kwargs) -> None:
        pass


@pytest.mark.parametrize("ks", [[0, 0, 2], [1, 0, 3], [0, 1, 0]], ids=lambda ks: "-".join(map(str, ks)))
def test_joint_distribution_is_exact_when_k_changes(markov, ks):
    target, drafts = markov
    params = SamplingParams(temperature=1.0, seed=7, max_new_tokens=JOINT_TOKENS)
    exact = target.continuation_probs(JOINT_PROMPT, JOINT_TOKENS, params)
    counts, stats = _joint_counts(target, ModelDrafter(drafts["close"]), params, Scripted(ks), JOINT_N)
    assert_distributed_as(counts, exact.ravel(), are_counts=True, label=f"scripted k={ks}")
    assert stats.proposed > 0


def test_joint_distribution_is_exact_under_the_adaptive_policy(markov):
    target, drafts = markov
    params = SamplingParams(temperature=0.8, top_k=4, seed=8, max_new_tokens=JOINT_TOKENS)
    exact = target.continuation_probs(JOINT_PROMPT, JOINT_TOKENS, params)
    counts, _ = _joint_counts(target, ModelDrafter(drafts["close"]), params, AdaptiveLength(k_max=4), JOINT_N)
    assert_distributed_as(counts, exact.ravel(), are_counts=True, label="adaptive")


@pytest.fixture(scope="module")
def llama_pair():
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    target = init_weights(LlamaForCausalLM(config), std=0.3, seed=1).eval()
    other = init_weights(LlamaForCausalLM(config.replace(num_hidden_layers=1)), std=0.3, seed=2).eval()
    return target, other


@pytest.mark.parametrize("policy", [lambda: Scripted([0, 0, 0, 5, 0, 2, 0, 0, 0, 0, 3]), lambda: AdaptiveLength(k_max=6, probe_every=3)], ids=["scripted", "adaptive"])
@pytest.mark.parametrize("draft", ["self", "other"])
def test_greedy_output_is_identical_whatever_the_policy(llama_pair, policy, draft):
    target, other = llama_pair
    prompts = [[1, 2, 3], [5], [7, 8, 9, 10, 11]]
    params = SamplingParams(temperature=0, max_new_tokens=40)
    plain = generate_all(target, prompts, params)
    stats = SpecStats()
    spec = generate_all(target, prompts, params, ModelDrafter(target if draft == "self" else other), k=policy(), stats=stats)
    assert spec == plain
    if draft == "self":
        assert stats.alpha_hat >= 0.98


def _feed(policy: AdaptiveLength, alpha: float, t_draft: float, t_target, iterations: int = 60) -> list[int]:
    """Drive the policy with synthetic observations: constant beta, draft seconds per token,
    and t_target(n) for the n = k+1 positions of each pass. Returns the chosen lengths."""
    chosen = []
    for _ in range(iterations):
        k = policy.choose()
        chosen.append(k)
        policy.observe(k, [alpha] * k, [1] * k, t_draft * k, t_target(k + 1))
    return chosen


def test_adaptive_speculates_when_it_pays_and_matches_the_closed_form():
    policy = AdaptiveLength(k_max=16)
    chosen = _feed(policy, alpha=0.8, t_draft=0.05, t_target=lambda n: 1.0)
    assert chosen[-1] == near_best_k(0.8, 0.05, 16) and chosen[-1] >= 3


@pytest.mark.parametrize(
    "alpha, t_draft, t_target, why",
    [
        (0.05, 0.05, lambda n: 1.0, "low acceptance"),
        (0.9, 1.0, lambda n: 1.0, "draft as expensive as the target"),
        (0.9, 0.05, lambda n: float(n), "compute-bound verification: r(n) = n"),
    ],
)
def test_adaptive_backs_off_and_only_probes(alpha, t_draft, t_target, why):
    policy = AdaptiveLength(k_max=8, probe_every=16)
    chosen = _feed(policy, alpha, t_draft, t_target, iterations=96)
    tail = chosen[32:]
    assert tail.count(0) >= len(tail) * 14 // 16, (why, chosen)
    assert set(tail) <= {0, 1}, (why, chosen)


def test_a_draft_too_slow_to_ever_pay_is_not_probed():
    """c = 1 (the target drafting for itself): no k pays even at acceptance 1, so probing for
    acceptance is pointless: no probe after the first measurements, while a cheap bad draft
    keeps being probed."""
    slow, bad = AdaptiveLength(k_max=8, probe_every=16), AdaptiveLength(k_max=8, probe_every=16)
    slow_chosen = _feed(slow, alpha=1.0, t_draft=1.0, t_target=lambda n: 1.0, iterations=160)
    bad_chosen = _feed(bad, alpha=0.02, t_draft=0.05, t_target=lambda n: 1.0, iterations=160)
    assert sum(k > 0 for k in slow_chosen[8:]) == 0 and sum(k > 0 for k in bad_chosen[8:]) >= 8, (slow_chosen, bad_chosen)


def _probing_policy():
    """The cost model of the probing tests below (drafting pays at 32 rows only if nearly
    every proposal were accepted), and a feed of `iterations` passes at one batch size and
    acceptance."""
    t_target = lambda n: 0.2 + n / 30  # noqa: E731
    policy = _calibrated(t_target, lambda b: 0.05)

    def feed(batch: int, iterations: int, alpha: float = 0.75) -> list[int]:
        chosen = []
        for _ in range(iterations):
            k = policy.choose(batch)
            chosen.append(k)
            policy.observe(k, [alpha * batch] * k, [batch] * k, k * 0.05, t_target(batch * (k + 1)), batch)
        return chosen

    return policy, feed


def test_probes_that_find_drafting_still_does_not_pay_come_less_often_until_it_does():
    """32 rows whose pass is compute-bound enough that drafting pays only if nearly every
    proposal were accepted (S(1) = 0.93 at acceptance 0.75, 1.06 at 1): after the first 16 betas
    the policy probes k = 1 after 16 plain passes, then 32, 64, and then every 128 (8 *
    probe_every; a policy whose gap stayed at probe_every, the negative control, gives 16s).
    Then a single row, where drafting pays: the policy drafts. Back at 32 rows the gap is that
    batch size's own, still 128: the drafting at one row measured acceptance already, and a
    probe at 32 rows costs a catch-up of every row's tokens since the draft last ran."""
    policy, feed = _probing_policy()
    chosen = feed(32, 600)
    probes = [i for i, k in enumerate(chosen) if k > 0][1:]  # past the evidence phase: one pass of 32 betas
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [32, 64, 128, 128] and set(chosen) == {0, 1}, gaps
    assert feed(1, 30)[-10:].count(0) == 0
    chosen = feed(32, 140)
    assert chosen.index(1) == 127, chosen


def test_a_batch_size_not_seen_yet_probes_on_the_gap_of_the_nearest_one_seen():
    """Backed off at 32 rows with probes there every 128 plain passes, the batch runs short
    (30 rows, then 18) after a probe: the next probe comes 128 passes after it, not 16 (a
    fresh gap at each new batch size: the negative control, a policy that has seen only
    32 rows' neighbour at 4 rows, where probes come every 16, probes at 30 rows after 16)."""
    policy, feed = _probing_policy()
    chosen = feed(32, 600)
    since = len(chosen) - 1 - max(i for i, k in enumerate(chosen) if k > 0)  # plain passes since the last probe
    short = feed(30, 60) + feed(18, 200)
    assert short.index(1) + since + 1 == 128, (since, short.index(1))

    control, feed_control = _probing_policy()
    feed_control(4, 40, alpha=0.1)  # 4 rows, where acceptance this low does not pay either: probes every 16 at most
    assert control._gap(4) <= 32 and feed_control(30, 40).index(1) < 32


def test_a_return_to_drafting_that_does_not_last_counts_as_a_probe_that_failed():
    """Backed off at 32 rows (probes every 128), two single-row passes whose every proposal is
    accepted lift the acceptance estimate, faded by the long back-off, to about 1, where drafting
    at 32 rows pays: the policy returns there, the betas of 0.75 pull the estimate down within
    a few passes and it backs off. That return is a failed probe: the next comes 128 plain
    passes later, not 16. The control: a return that lasts (acceptance 1 for 30 passes at 32
    rows before it falls to 0.75) ends with the next probe after 16, as drafting paid."""

    def gap_after_return(lasting: int) -> tuple[int, int]:
        policy, feed = _probing_policy()
        feed(32, 600)
        feed(1, 2, alpha=1.0)
        chosen = feed(32, lasting, alpha=1.0) + feed(32, 400)
        drafted = [i for i, k in enumerate(chosen) if k > 0]
        # the return's last pass: the first followed by more than two plain ones (a plain pass is
        # measured now and then while drafting gains less than `explore`)
        run_end = next(i for i, j in zip(drafted, drafted[1:]) if j - i > 3)
        return run_end + 1, next(i for i in drafted if i > run_end) - run_end - 1

    lasted, gap = gap_after_return(0)
    assert lasted < AdaptiveLength.recent and gap + 1 == 128, (lasted, gap)
    lasted, gap = gap_after_return(30)
    assert lasted >= AdaptiveLength.recent and gap + 1 == 16, (lasted, gap)


def test_a_drafting_pass_that_catches_up_does_not_count_as_the_drafts_cost():
    """A model draft's first pass reads the whole prompt, and a pass after plain passes reads
    every token since: a slow pass that must not make the policy think drafting is dear."""
    policy = AdaptiveLength(k_max=8, prior_c=0.05, prior_r=[1.0] * 9)
    first = policy.choose()
    policy.observe(first, [0.8] * first, [1] * first, 50.0, 1.0)  # the prompt read by the draft: 50 target passes' worth
    chosen = [policy.choose()]
    for _ in range(30):
        k = chosen[-1]
        policy.observe(k, [0.8] * k, [1] * k, 0.05 * k, 1.0)
        chosen.append(policy.choose())
    assert min(chosen) > 0 and chosen[-1] == near_best_k(0.8, 0.05, 8), chosen


@pytest.mark.parametrize("prior_c, expect_draft", [(0.05, True), (2.0, False)])
def test_a_cost_profile_lets_the_first_choice_be_right(prior_c, expect_draft):
    """Seeded with c and r(n) from the profiler, the first iteration already speculates when
    drafting is cheap and does not when it is dear (unseeded, it always starts with k = 0)."""
    policy = AdaptiveLength(k_max=8, prior_c=prior_c, prior_r=[1.0] * 9)
    first = policy.choose()
    assert (first > 0) == expect_draft
    assert AdaptiveLength(k_max=8).choose() == 0
    if expect_draft:  # and its choice follows the measurements once they come
        chosen = _feed(policy, alpha=0.8, t_draft=0.05, t_target=lambda n: 1.0)
        assert chosen[-1] == near_best_k(0.8, 0.05, 8)


def test_policies_validate_their_arguments():
    with pytest.raises(ValueError, match="k must be"):
        FixedLength(-1)
    with pytest.raises(ValueError, match="k_max"):
        AdaptiveLength(k_max=0)
    with pytest.raises(ValueError, match="decay"):
        AdaptiveLength(decay=0)
    with pytest.raises(ValueError, match="probe_every"):
        AdaptiveLength(probe_every=0)
    with pytest.raises(ValueError, match="prior_c"):
        AdaptiveLength(prior_c=-0.1)
    with pytest.raises(ValueError, match="prior_r"):
        AdaptiveLength(prior_r=[1.0, 0.0])
    with pytest.raises(ValueError, match="explore"):
        AdaptiveLength(explore=-0.1)
    with pytest.raises(ValueError, match="refresh_every"):
        AdaptiveLength(refresh_every=0)
    with pytest.raises(ValueError, match="switch"):
        AdaptiveLength(switch=-0.01)


def test_a_float32_beta_just_above_one_is_taken_as_one():
    """beta = sum min(p, q) in float32 reads 1 + 1e-7 for a certain token (a self draft)."""
    policy = AdaptiveLength(k_max=4, prior_c=0.1, prior_r=[1.0] * 5, prior_weight=0.0)  # the betas alone
    policy.observe(2, [2.0000001, 2.0000001], [2, 2], 0.02, 0.1)
    assert policy.alphas() == [1.0] * 4 and policy.choose() == 4


def _feed_batches(policy: AdaptiveLength, batches: list[int], alpha: float, t_target, t_draft: float, iterations: int) -> dict[int, list[int]]:
    """Synthetic passes at several batch sizes, in turn: t_target(N) over the N = B*(k+1)
    positions of a pass, t_draft seconds per proposed token over all rows. Returns each batch
    size's choices."""
    chosen: dict[int, list[int]] = {b: [] for b in batches}
    for i in range(iterations):
        batch = batches[i % len(batches)]
        k = policy.choose(batch=batch)
        chosen[batch].append(k)
        policy.observe(k, [alpha * batch] * k, [batch] * k, t_draft * batch * k, t_target(batch * (k + 1)), batch=batch)
    return chosen


def test_adaptive_backs_off_where_the_batch_makes_the_pass_compute_bound():
    # a pass costs the same up to 16 positions (memory-bound), then grows like the positions (compute-bound)
    t_target = lambda n: max(1.0, n / 16)  # noqa: E731
    chosen = _feed_batches(AdaptiveLength(k_max=8), [1, 32], alpha=0.8, t_target=t_target, t_draft=0.02, iterations=400)
    assert chosen[1][-1] >= 3  # one row: 4+ positions cost what one does
    assert chosen[32][-20:] == [0] * 20 or max(chosen[32][-20:]) <= 1  # 32 rows: every extra position costs in full: plain (or a probe)
    assert chosen[32][-20:].count(0) >= 18


def test_adaptive_without_batch_sizes_is_what_it_was():
    # batch 1 throughout: the same choices as before batch sizes were counted
    a = _feed(AdaptiveLength(k_max=8), alpha=0.7, t_draft=0.05, t_target=lambda n: 1.0 + 0.1 * n)
    b = _feed_batches(AdaptiveLength(k_max=8), [1], alpha=0.7, t_target=lambda n: 1.0 + 0.1 * n, t_draft=0.05, iterations=60)[1]
    assert a == b


def _calibrated(t_target, t_draft_step, sizes=(1, 2, 4, 8, 16, 32), k_max: int = 8) -> AdaptiveLength:
    """A policy seeded as profiler.calibrate seeds it: t_target at every B(k+1) and t_draft at
    every (B, k), acceptance untouched. t_draft_step(B): one draft step over B rows."""
    policy = AdaptiveLength(k_max=k_max)
    policy.seed_costs({b * (k + 1): t_target(b * (k + 1)) for b in sizes for k in range(k_max + 1)},
                      {(b, k): k * t_draft_step(b) for b in sizes for k in range(1, k_max + 1)})
    return policy


def test_a_calibrated_policy_chooses_right_at_every_batch_size_from_the_first_pass():
    """Memory-bound up to 16 positions, then compute-bound; a draft step over B rows costs 0.06
    up to 8 rows, then grows. Calibrated, the first choice at one row is the closed form's k
    at these costs (prior acceptance 0.7) and at 32 rows it is plain with no probe ever
    (no k pays there even if every proposal were accepted); uncalibrated, the first choice is 0."""
    t_target = lambda n: max(1.0, n / 16)  # noqa: E731
    t_step = lambda b: 0.06 * max(1.0, b / 8)  # noqa: E731
    policy = _calibrated(t_target, t_step)
    s = [(1 - 0.7 ** (k + 1)) / 0.3 / (t_target(k + 1) + k * 0.06) for k in range(9)]
    expected = next(k for k in range(9) if s[k] >= (1 - policy.tolerance) * max(s))  # the shortest near the best
    assert policy.choose(batch=1) == expected >= 3
    assert AdaptiveLength(k_max=8).choose(batch=1) == 0
    chosen = []
    for _ in range(40):  # 32 rows at acceptance 0.9: still plain, never a probe
        k = policy.choose(batch=32)
        chosen.append(k)
        policy.observe(k, [0.9 * 32] * k, [32] * k, k * t_step(32), t_target(32 * (k + 1)), batch=32)
    assert chosen == [0] * 40, chosen


def test_draft_seconds_are_measured_fitted_over_k_or_interpolated_over_batch_sizes():
    table = {(size, k): 0.02 + step * k for size, step in ((2, 0.1), (8, 0.3)) for k in (1, 2, 3)}
    assert _draft_time(table, 2, 2) == pytest.approx(0.22)  # measured
    assert _draft_time(table, 2, 4) == pytest.approx(0.42)  # the line over k at 2 rows
    assert _draft_time(table, 4, 3) == pytest.approx(0.32 + (0.92 - 0.32) * 2 / 6)  # between 2 and 8 rows
    assert _draft_time(table, 16, 1) == pytest.approx(0.32 * 2)  # beyond: proportional to the rows
    assert _draft_time({}, 1, 1) is None and AdaptiveLength().draft_seconds(1, 1) is None


def test_one_stalled_pass_does_not_flip_the_choice():
    """Times are medians of the last passes with their key: a pass stretched twentyfold (the
    core taken by another thread) leaves the choice where it was; a lasting change moves it
    (plain passes, seen `recent` times before, keep their own time)."""
    policy = _calibrated(lambda n: 1.0, lambda b: 0.05)
    for _ in range(policy.recent):
        policy.observe(0, [], [], 0.0, 1.0)
    chosen = _feed(policy, alpha=0.8, t_draft=0.05, t_target=lambda n: 1.0, iterations=30)
    k = chosen[-1]
    assert k == near_best_k(0.8, 0.05, 8)
    policy.observe(k, [0.8] * k, [1] * k, 0.05 * k, 20.0)  # one stalled pass at this k
    assert policy.choose() == k
    for _ in range(20):  # the same pass, slow every time now: drafting this long stops paying
        policy.observe(k, [0.8] * k, [1] * k, 0.05 * k, 20.0)
    assert policy.choose() != k


def test_calibrated_costs_are_scaled_by_what_passes_take_in_service():
    """The calibration says drafting one or two tokens pays at 16 rows; in service
    a drafting pass takes 1.7 times the calibration's time and a plain one 1.1 times (the
    server's threads share the cores; `recent` plain passes have been seen): the policy goes
    plain within a few dozen passes and stays there but for probes. Served at the
    calibration's own times, it keeps drafting."""
    t_target = lambda n: max(1.0, n / 24)  # noqa: E731
    t_step = lambda b: 0.05  # noqa: E731

    def serve(slower: float, plain_slower: float) -> list[int]:
        policy = _calibrated(t_target, t_step)
        for _ in range(policy.recent):
            policy.observe(0, [], [], 0.0, plain_slower * t_target(16), batch=16)
        chosen = []
        for _ in range(120):
            k = policy.choose(batch=16)
            chosen.append(k)
            scale = plain_slower if k == 0 else slower
            policy.observe(k, [0.75 * 16] * k, [16] * k, scale * k * t_step(16), scale * t_target(16 * (k + 1)), batch=16)
        return chosen

    assert serve(1.0, 1.0)[-40:].count(0) == 0
    stretched = serve(1.7, 1.1)[-40:]
    assert stretched.count(0) >= 36 and set(stretched) <= {0, 1}, stretched


def test_where_the_predicted_speedup_is_flat_the_shorter_draft_is_chosen():
    """Memory-bound passes (t_target 1 at any width) and a draft step of 0.115: at the prior
    acceptance 0.7, S(3) = 1.883 and S(4) = 1.899, the argmax. Within 1% of the best, the policy
    takes k = 3; with tolerance 0 (the negative control) the argmax, 4. S(2) = 1.780 is not
    within 1%, so the rule is not just 'shorter'."""
    from verispec.policy import shortest_near_best

    calibrated = lambda **kw: _calibrated(lambda n: 1.0, lambda b: 0.115, **kw)  # noqa: E731
    assert calibrated().choose(batch=1) == 3
    policy = calibrated()
    policy.tolerance = 0.0
    assert policy.choose(batch=1) == 4
    assert shortest_near_best([1.0, 1.5, 2.0, 1.99], 0.03) == 2 and shortest_near_best([1.0, 0.98], 0.03) == 0
    with pytest.raises(ValueError, match="tolerance"):
        AdaptiveLength(tolerance=1.0)


def test_a_deep_position_seen_a_few_times_is_pulled_toward_the_first():
    """Sixty k = 3 passes at acceptance 0.7 everywhere, then two k = 8 passes whose deep betas
    all came out 1 (greedy betas are 0 or 1). With `shrink` the deep positions stay under 0.85
    and the policy lengthens its draft by one (S(4) is within 1% of the best); with shrink 0
    (the negative control) two betas put them above 0.9 and the policy jumps to k >= 7."""
    def run(shrink: float) -> tuple[list[float], int]:
        policy = AdaptiveLength(k_max=8, shrink=shrink)
        policy.seed_costs({k + 1: 1.0 for k in range(9)}, {(1, k): 0.115 * k for k in range(1, 9)})
        for _ in range(60):
            policy.observe(3, [0.7] * 3, [1] * 3, 0.345, 1.0)
        assert policy.choose() == 3
        for _ in range(2):
            policy.observe(8, [0.7, 0.7, 0.7] + [1.0] * 5, [1] * 8, 0.92, 1.0)
        return policy.alphas(), policy.choose()

    alphas, k = run(AdaptiveLength.shrink)
    assert AdaptiveLength.shrink > 0 and max(alphas[3:]) < 0.85 and k == 4, (alphas, k)
    alphas, k = run(0.0)
    assert min(alphas[3:]) > 0.9 and k >= 7, (alphas, k)


def test_calibrated_times_are_smoothed_by_a_line_over_k():
    """A calibration whose k = 4 pass came out 30% slow by chance (three passes on a busy
    machine): the time the policy uses at k = 4 is the line's, within 8% of the straight
    neighbours' trend, and at k = 0 the calibration's own. A falling line is held flat."""
    from verispec.policy import _fitted_line

    policy = AdaptiveLength(k_max=8)
    draft = {(1, k): 0.1 * k for k in range(1, 9)}
    draft[(1, 4)] *= 1 + 0.3 * 1.4 / 0.4  # the iteration 1.4 + 0.4 comes out 30% of 1.4 longer
    policy.seed_costs({k + 1: 1.0 for k in range(9)}, draft)
    assert policy.calibrated_seconds(1, 0) == pytest.approx(1.0)
    assert policy.calibrated_seconds(1, 4) == pytest.approx(1.4, rel=0.08)
    assert policy.calibrated_seconds(1, 4) < 1.4 * 1.3 * 0.9
    assert [policy.calibrated_seconds(1, k) for k in range(1, 9)] == pytest.approx(_fitted_line([1.0 + 0.1 * k + (0.42 if k == 4 else 0) for k in range(1, 9)]))
    assert _fitted_line([3.0, 2.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0]) and _fitted_line([5.0]) == [5.0]


def test_the_service_stretch_of_drafting_passes_is_pooled_over_k():
    """Drafting passes in service take 1.2 times the calibration's at k = 3 (twenty of them);
    k = 5 never ran: it is stretched by the same 1.2, not by 1. So are plain passes until
    `recent` of them have run; then they have their own."""
    policy = _calibrated(lambda n: 1.0, lambda b: 0.1)
    for _ in range(20):
        policy.observe(3, [0.7] * 3, [1] * 3, 0.3 * 1.2, policy.calibrated_seconds(1, 3) * 1.2 - 0.3 * 1.2)
    assert policy.stretch(3) == pytest.approx(1.2) and policy.stretch(5) == pytest.approx(1.2)
    assert policy.stretch(0) == pytest.approx(1.2)
    for _ in range(policy.recent - 1):
        policy.observe(0, [], [], 0.0, policy.calibrated_seconds(1, 0) * 0.9)
    assert policy.stretch(0) == pytest.approx(1.2)
    policy.observe(0, [], [], 0.0, policy.calibrated_seconds(1, 0) * 0.9)
    assert policy.stretch(0) == pytest.approx(0.9) and policy.stretch(3) == pytest.approx(1.2)


def test_a_few_slow_plain_passes_do_not_make_plain_look_dear():
    """At 16 rows the calibration says plain pays (S(1) < 1 at acceptance 0.73); drafting
    passes run 1.1 times the calibration's, and the only two plain passes seen took 1.9 times
    (a server's first passes after joins, measured). The policy goes plain, as the calibration
    says. The negative control trusts a kind after one pass (recent = 1): it keeps drafting."""
    t_target = lambda n: max(1.0, n / 16)  # noqa: E731

    def choice(recent: int) -> int:
        policy = _calibrated(t_target, lambda b: 0.1)
        policy.recent = recent
        for _ in range(30):
            policy.observe(1, [0.73 * 16], [16], 1.1 * 0.1, 1.1 * t_target(32), batch=16)
        for _ in range(2):
            policy.observe(0, [], [], 0.0, 1.9 * t_target(16), batch=16)
        return policy.choose(batch=16)

    assert choice(AdaptiveLength.recent) == 0
    assert choice(1) >= 1


def test_the_evidence_before_backing_off_counts_betas_over_all_rows():
    """A draft step costs half a plain pass: at acceptance 0.3 drafting does not pay at 1 or 32
    rows, though it would if every proposal were accepted. A fresh policy drafts one token until
    the first position has `min_evidence` betas: at 32 rows one pass gives 32 (one k = 1 pass,
    then plain for 15); at one row every one of the 16 passes drafts (no plain pass measured
    where the prior acceptance makes drafting look marginal: `explore` 0)."""
    def drafting_passes(batch: int) -> int:
        t_target = lambda n: max(1.0, n / 48)  # noqa: E731
        policy = _calibrated(t_target, lambda b: 0.5)
        policy.explore = 0.0
        drafted = 0
        for _ in range(16):
            k = policy.choose(batch=batch)
            drafted += k > 0
            policy.observe(k, [0.3 * batch] * k, [batch] * k, 0.5 * k, t_target(batch * (k + 1)), batch=batch)
        return drafted

    assert drafting_passes(32) == 1
    assert drafting_passes(1) == 16 == AdaptiveLength.min_evidence


def test_the_service_stretch_is_the_batch_sizes_own_once_it_has_seen_enough():
    """Drafting passes run 0.8 times the calibration's at one row and 1.25 times at 8 rows (the
    calibration's shape over batch sizes is off; measured: 0.85-0.93 at one row, 1.04 at 8).
    Until 8 rows has seen `recent` drafting passes it borrows the pooled stretch; then its own,
    while one row keeps its own and a batch size never served keeps the pooled one."""
    policy = _calibrated(lambda n: 1.0, lambda b: 0.1)

    def serve(batch: int, ratio: float, passes: int) -> None:
        for _ in range(passes):
            seconds = policy.calibrated_seconds(batch, 2) * ratio
            policy.observe(2, [0.7 * batch] * 2, [batch] * 2, 0.0, seconds, batch=batch)

    serve(1, 0.8, 20)
    serve(8, 1.25, policy.recent)  # the first pass at 8 rows, right after the batch size changed, is not timed
    assert policy.stretch(2, 8) == pytest.approx(0.8)
    serve(8, 1.25, 1)
    assert policy.stretch(2, 8) == pytest.approx(1.25) and policy.stretch(5, 8) == pytest.approx(1.25)
    assert policy.stretch(2, 1) == pytest.approx(0.8) and policy.stretch(2, 4) == pytest.approx(0.8)


def test_a_pass_right_after_rows_left_or_joined_is_not_timed():
    """Drafting passes at 4 rows that each come right after a pass at 32 rows (28 rows just left)
    take five times the calibration's: their seconds carry the bookkeeping of the rows that left,
    not what drafting at 4 rows costs, and are not timed (the stretch at 4 rows stays at 1: nothing
    timed). The control: the same slow passes after a pass at 4 rows are timed, and set it at 5."""

    def stretch_at_4(previous: int) -> float:
        policy = _calibrated(lambda n: 1.0, lambda b: 0.1)
        for _ in range(2 * policy.recent):
            policy.observe(1, [0.7 * previous], [previous], 0.0, policy.calibrated_seconds(previous, 1), batch=previous)
            policy.observe(2, [0.7 * 4] * 2, [4] * 2, 0.0, 5 * policy.calibrated_seconds(4, 2), batch=4)
        return policy.stretch(2, 4)

    assert stretch_at_4(32) == pytest.approx(1.0)
    assert stretch_at_4(4) == pytest.approx(5.0)


def test_where_drafting_looks_marginal_plain_passes_are_measured_at_that_batch_size():
    """At 8 rows the calibration predicts S(1) = 1.25 / 1.1 = 1.14 at acceptance 0.25 (after 30
    drafting passes have shown it). In service plain passes take 0.8 of the calibration's time
    and drafting ones 1.0, so drafting runs at 0.91 of plain. The policy measures plain there
    (S < 1 + explore) and goes plain; the negative control (explore 0) never runs a plain pass
    and drafts throughout."""
    t_target = lambda n: max(1.0, n / 16)  # noqa: E731

    def serve(explore: float) -> list[int]:
        policy = _calibrated(t_target, lambda b: 0.1)
        policy.explore = explore
        for _ in range(30):
            policy.observe(1, [0.25 * 8], [8], 0.1, t_target(16), batch=8)
        assert policy.predicted_speedups(8)[1] == pytest.approx(1.25 / 1.1, rel=0.02)
        chosen = []
        for _ in range(120):
            k = policy.choose(batch=8)
            chosen.append(k)
            scale = 0.8 if k == 0 else 1.0
            policy.observe(k, [0.25 * 8] * k, [8] * k, scale * 0.1 * k, scale * t_target(8 * (k + 1)), batch=8)
        return chosen

    explored = serve(AdaptiveLength.explore)
    assert explored[:AdaptiveLength.recent] == [0] * AdaptiveLength.recent
    assert explored[-60:].count(0) >= 56, explored
    assert serve(0.0) == [1] * 120


def test_a_burst_of_slow_plain_passes_stops_deciding_once_it_is_old(monkeypatch):
    """At 16 rows plain passes take 0.85 of the calibration and a k = 1 iteration 1.6, so at
    acceptance 0.7 drafting runs at 1.7 * 0.85 / 1.6 = 0.90 of plain. Then nine plain passes
    in a row take 1.1 (a busy moment): their median says S(1) = 1.17 and the policy drafts,
    measuring one plain pass (at 0.85) after every 16 drafting ones (S < 1 + explore). Once the
    oldest of the nine is 4 * recent passes old the iteration median no longer decides; the
    plain stretch at 16 rows (its last 27 passes, most of them at 0.85) does, and the policy
    goes back to plain. The negative control dates the window by its latest value, as before:
    the plain passes it measures keep the burst's median standing and it goes on drafting."""
    from verispec import control

    t_target = lambda n: 1.0 + max(0, n - 16) / 32  # noqa: E731

    def serve() -> list[int]:
        policy = _calibrated(t_target, lambda b: 0.1)
        for _ in range(27):
            policy.observe(0, [], [], 0.0, 0.85, batch=16)
        for _ in range(30):
            policy.observe(1, [0.7 * 16], [16], 0.1, 1.5, batch=16)
        for _ in range(9):
            policy.observe(0, [], [], 0.0, 1.1, batch=16)
        chosen = []
        for _ in range(80):
            k = policy.choose(batch=16)
            chosen.append(k)
            policy.observe(k, [0.7 * 16] * k, [16] * k, 0.1 * k, 0.85 if k == 0 else t_target(16 * (k + 1)), batch=16)
        return chosen

    chosen = serve()
    assert chosen[:16] == [1] * 16  # the burst decides while it is recent
    assert chosen[-30:].count(0) >= 27, chosen  # then plain, but for a probe or two
    monkeypatch.setattr(control._Recent, "oldest", property(lambda self: self._ats[-1]))
    assert serve()[-30:].count(1) >= 27


def test_iteration_times_measured_in_service_replace_the_calibrations_line():
    """The calibration's line over k rises 0.45 a drafted token at 2 rows; in service an
    iteration rises 0.25 (measured at 2 rows: 6.8 ms against 5). At acceptance 0.7 the line
    makes k = 1 look best (S 1.17 against 1.15 at k = 2); in service k = 2 gives 1.46 against
    1.36. After plain, k = 1 and k = 2 have each run `recent` times the policy takes k = 2; the
    negative control, which never trusts so few (recent = 100), keeps the line's k = 1."""
    def choice(recent: int) -> int:
        policy = _calibrated(lambda n: 1.0, lambda b: 0.45)
        policy.recent, policy.explore = recent, 0.0
        for _ in range(9):
            policy.observe(0, [], [], 0.0, 1.0, batch=2)
        for k in [1] * 10 + [2] * 10:
            policy.observe(k, [0.7 * 2] * k, [2] * k, 0.25 * k, 1.0, batch=2)
        return policy.choose(batch=2)

    assert choice(AdaptiveLength.recent) == 2
    assert choice(100) == 1


def test_a_deep_position_an_earlier_rejection_kept_unverified_keeps_its_evidence():
    """k = 4 at one row: positions 1-2 accepted with beta 0.6, positions 3-4 reached on every
    other iteration (an earlier rejection on the others) and accepted with beta 0.95 there. An
    iteration that proposed a position but never reached it says nothing about it, so its
    estimate keeps its weight and stays near 0.95 (shrink pulls it a little toward the
    first's); fading it there, as for a position not proposed, held its weight near shrink's
    and the estimate near 0.77. Positions past k still fade."""
    policy = AdaptiveLength(k_max=8)
    policy.seed_costs({n: 1.0 for n in range(1, 10)}, {(1, k): 0.05 * k for k in range(1, 9)})
    for i in range(200):
        reached = i % 2 == 0
        policy.observe(4, [0.6, 0.6] + ([0.95, 0.95] if reached else [0.0, 0.0]), [1, 1] + ([1, 1] if reached else [0, 0]), 0.2, 1.0)
    alphas = policy.alphas()
    assert alphas[2] > 0.85 and alphas[3] > 0.85, alphas
    assert max(alphas[4:]) < 0.8, alphas  # not proposed: faded back toward the one before, pulled toward the first


def test_the_first_pass_at_a_new_shape_is_not_timed():
    """llama.cpp sizes its buffers on the first pass at a new number of positions: that pass (100 ms
    here, where the next one takes 10) is left out, so the one steady pass is the time at that
    shape (a median with the slow one in it would say 55 ms). The draft's time likewise."""
    policy = AdaptiveLength(k_max=4)
    for target_s in (0.100, 0.010):
        policy.observe(0, [], [], 0.0, target_s)
    assert policy.target_seconds(1) == pytest.approx(0.010)
    for draft_s, target_s in ((0.001, 0.100), (0.050, 0.012), (0.002, 0.012)):  # the first at 3 positions (a catch-up), the first at (1, 2), a steady one
        policy.observe(2, [0.7, 0.7], [1, 1], draft_s, target_s)
    assert policy.target_seconds(3) == pytest.approx(0.012) and policy.draft_seconds(1, 2) == pytest.approx(0.002)


def test_past_the_positions_measured_the_profiles_shape_extrapolates():
    """A profile says t_target(n) is concave (r = 1, 1.1, 1.2, 1.5, 1.6, 1.7); passes ran at 1, 2
    and 4 positions only. Past 4 the time is t(4) scaled by the profile's shape (t(6) = t(4) *
    1.7 / 1.5), not the line through 2 and 4 (which would say 16 ms at 6 positions); between
    measured points it is still linear."""
    policy = AdaptiveLength(k_max=5, prior_r=(1.0, 1.1, 1.2, 1.5, 1.6, 1.7))
    for n, t in ((1, 0.010), (2, 0.011), (4, 0.0135)):
        for _ in range(4):  # the first is not timed; three make a steady median
            policy.observe(n - 1, [0.7] * (n - 1), [1] * (n - 1), 0.001 * (n - 1), t)
    assert policy.target_seconds(6) == pytest.approx(0.0135 * 1.7 / 1.5)
    assert policy.target_seconds(3) == pytest.approx((0.011 + 0.0135) / 2)


def test_backed_off_drafting_resumes_only_for_a_gain_worth_the_catch_up():
    """16 rows, acceptance 0.75, a k = 1 iteration takes 1.8 in service. Plain passes take 1.0:
    drafting loses (S(1) = 0.97) and the policy backs off. Then plain passes take 1.06: drafting
    is predicted to gain 3%, under `switch` (5%), and the policy stays plain but for probes (each
    return would pay a catch-up for a gain within the noise of its estimates); the negative
    control (switch 0) goes back to drafting. At 1.2 (a predicted 17% gain) both draft."""
    t_target = lambda n: 1.0 + max(0, n - 16) / 24  # noqa: E731

    def serve(switch: float) -> list[list[int]]:
        policy = _calibrated(t_target, lambda b: 0.1)
        policy.switch = switch
        phases = []
        for plain_s in (1.0, 1.06, 1.2):
            chosen = []
            for _ in range(200):
                k = policy.choose(batch=16)
                chosen.append(k)
                policy.observe(k, [0.75 * 16] * k, [16] * k, 0.1 * k, plain_s if k == 0 else 1.7 + 0.6 * (k - 1), batch=16)
            phases.append(chosen[-100:])
        return phases

    backed_off, near_tie, paying = serve(AdaptiveLength.switch)
    assert backed_off.count(0) >= 97 and near_tie.count(0) >= 97, (backed_off, near_tie)
    assert paying.count(1) >= 90, paying
    control = serve(0.0)
    assert control[1].count(1) >= 90, control[1]


def test_backed_off_a_busy_moment_that_slows_plain_passes_does_not_bring_drafting_back(monkeypatch):
    """16 rows, acceptance 0.75: a k = 1 iteration takes 1.8 (measured in 27 passes) and a plain
    pass 1.0 (S(1) = 0.97), and the policy backs off. Then a busy moment slows every pass by 15%
    for 12 passes: the median of plain's last `recent` passes says 1.15, and against drafting's
    older time S(1) reads 1.09-1.12, over `switch`. Judged against the faster of plain's last
    `recent` and last 3 * recent passes (1.0, `_calm`), the policy stays plain; the negative
    control (`_calm` at 1) goes back to drafting from the sixth busy pass, at 0.97 of plain."""
    t_target = lambda n: 1.0 + max(0, n - 16) / 24  # noqa: E731

    def serve() -> list[int]:
        policy = _calibrated(t_target, lambda b: 0.1)

        def run(slow: float, passes: int) -> list[int]:
            chosen = []
            for _ in range(passes):
                k = policy.choose(batch=16)
                chosen.append(k)
                policy.observe(k, [0.75 * 16] * k, [16] * k, 0.1 * k * slow, slow * (1.0 if k == 0 else 1.7 + 0.6 * (k - 1)), batch=16)
            return chosen

        for _ in range(3 * policy.recent):  # drafting's time at 16 rows is measured: a k = 1 iteration 1.8
            policy.observe(1, [0.75 * 16], [16], 0.1, 1.7, batch=16)
        assert run(1.0, 200)[-100:].count(0) >= 97
        return run(1.15, 12)

    assert sum(k > 0 for k in serve()) <= 1
    monkeypatch.setattr(AdaptiveLength, "_calm", lambda self, batch: 1.0)
    assert sum(k > 0 for k in serve()) >= 4


def _after_a_busy_moment(policy: AdaptiveLength, busy_plain_s: float, passes: int) -> list[int]:
    """16 rows: plain passes took busy_plain_s, then drafting ones (k = 1, 1.8 an iteration,
    acceptance 0.75); then the policy chooses for `passes` passes with plain ones at 1.0, where
    drafting loses (S(1) = 0.97). Returns its choices."""
    t_target = lambda n: 1.0 + max(0, n - 16) / 24  # noqa: E731
    policy.seed_costs({16 * (k + 1): t_target(16 * (k + 1)) for k in range(policy.k_max + 1)},
                      {(16, k): 0.1 * k for k in range(1, policy.k_max + 1)})
    for _ in range(3 * policy.recent):
        policy.observe(0, [], [], 0.0, busy_plain_s, batch=16)
    for _ in range(3 * policy.recent):
        policy.observe(1, [0.75 * 16], [16], 0.1, 1.7, batch=16)
    chosen = []
    for _ in range(passes):
        k = policy.choose(batch=16)
        chosen.append(k)
        policy.observe(k, [0.75 * 16] * k, [16] * k, 0.1 * k, 1.0 if k == 0 else 1.7 + 0.6 * (k - 1), batch=16)
    return chosen


def test_a_sparse_plain_time_is_measured_again_when_a_plain_pass_runs_well_under_it():
    """Plain passes took 1.15 in a busy moment, so drafting is predicted to gain 12%: under
    `explore`, so a plain pass is due every `probe_every` drafting passes. Those run at 1.0. The
    first one runs 13% under the plain median, which spans more than 4 * recent passes: it is
    dropped and `recent` new plain passes replace it, and the policy goes plain. The negative
    control (only a plain time `refresh_every` passes old is measured again) drafts on while
    one due pass after another moves the median of 27 by one place."""
    assert _after_a_busy_moment(AdaptiveLength(), 1.15, 200)[-150:].count(0) >= 145
    control = AdaptiveLength()
    control._plain_sparse = control._plain_stale
    assert _after_a_busy_moment(control, 1.15, 200)[-150:].count(0) <= 20


def test_a_plain_time_left_by_a_busy_moment_is_measured_again():
    """Plain passes took 1.6 in a busy moment, so drafting is predicted to gain 56% and no plain
    pass is measured there. Once the newest plain pass is `refresh_every` passes old one is
    measured, runs well under the old median, and `recent` new ones replace it: the policy goes
    plain. The negative control (no refresh) drafts on."""
    chosen = _after_a_busy_moment(AdaptiveLength(), 1.6, 800)
    assert chosen[:200].count(0) <= 2 and chosen[-300:].count(0) >= 290, chosen
    assert _after_a_busy_moment(AdaptiveLength(refresh_every=10**9), 1.6, 800)[-300:].count(0) <= 2


def test_a_return_to_drafting_pays_for_its_catch_up():
    """32 rows: a k = 1 iteration takes 1.55 plain passes; a drafting pass after m plain passes
    first reads 32 m tokens, 0.002 a token. At acceptance 0.2 the policy backs off; there each
    long back-off lets the acceptance estimate drift back to the prior (0.7, S(1) = 1.10), so a
    policy that ignores the catch-up goes back to drafting, catches up, finds 0.2 and backs off
    again (the negative control, whose catch-ups cost nothing to it: 11 drafting passes in 300).
    Costing the catch-up (learned from the probes: 0.002 a token) it only probes (3 in 300).
    Once acceptance is 0.75 (S(1) = 1.13) both draft."""
    t_target = lambda n: 1.0 + 0.45 * max(0, n - 32) / 32  # noqa: E731

    def serve(per_token: float) -> tuple[AdaptiveLength, list[int], list[int]]:
        policy, since = _calibrated(t_target, lambda b: 0.1), 0

        def run(alpha: float, passes: int) -> list[int]:
            nonlocal since
            chosen = []
            for _ in range(passes):
                k = policy.choose(batch=32)
                chosen.append(k)
                catch_up = per_token * 32 * since if k and since else 0.0
                policy.observe(k, [alpha * 32] * k, [32] * k, 0.1 * k + catch_up, t_target(32 * (k + 1)), batch=32)
                since = 0 if k else since + 1
            return chosen

        run(0.75, 60)
        return policy, run(0.2, 400)[-300:], run(0.75, 300)[-100:]

    policy, backed_off, paying = serve(0.002)
    assert policy._catch_up.get() == pytest.approx(0.002)
    assert sum(k > 0 for k in backed_off) <= 3 and paying.count(1) >= 90, (backed_off, paying)
    _, control, control_paying = serve(0.0)
    assert sum(k > 0 for k in control) >= 8 and control_paying.count(1) >= 90, control


def test_at_one_row_acceptance_averages_over_memory_betas_and_the_choice_stays_put():
    """One row, greedy betas (each 0 or 1) drawn at 0.7 at every position, memory-bound passes
    and a draft step of 0.115: k = 3 and 4 are within 1% of each other, and 2 and 5 are not.
    Over `memory` (160) betas the estimate stays near 0.7 and the policy chooses 3 or 4 on more
    than 99% of 1,900 passes; over 20 passes (memory 1: the negative control) +-0.1 swings send
    it to 2, 5 or 6 on more than 3% of them. Seeded: the same draws every run."""
    def off_choices(memory: int, seed: int) -> float:
        rng = random.Random(seed)
        policy = AdaptiveLength(k_max=8, memory=memory)
        policy.seed_costs({k + 1: 1.0 for k in range(9)}, {(1, k): 0.115 * k for k in range(1, 9)})
        chosen = []
        for _ in range(2000):
            k = policy.choose()
            chosen.append(k)
            betas: list[float] = []
            while len(betas) < k and (not betas or betas[-1]):  # verified up to the first rejection
                betas.append(float(rng.random() < 0.7))
            policy.observe(k, betas + [0.0] * (k - len(betas)), [1] * len(betas) + [0] * (k - len(betas)), 0.115 * k, 1.0)
        return sum(k not in (3, 4) for k in chosen[100:]) / len(chosen[100:])

    for seed in range(3):
        assert off_choices(AdaptiveLength.memory, seed) < 0.01
        assert off_choices(1, seed) > 0.03


def test_where_a_pass_brings_many_betas_the_estimate_follows_as_fast_as_before():
    """`memory` only slows an estimate fed fewer than memory / 20 betas a pass: at 32 rows a drop
    in acceptance from 0.7 to 0.3 takes the estimate below 0.4 in as many passes as with no memory."""
    def passes_to_follow(memory: int) -> int:
        policy = AdaptiveLength(k_max=8, memory=memory)
        for _ in range(100):
            policy.observe(3, [0.7 * 32] * 3, [32] * 3, 0.3, 1.0, batch=32)
        for i in range(100):
            policy.observe(3, [0.3 * 32] * 3, [32] * 3, 0.3, 1.0, batch=32)
            if policy.alphas()[0] < 0.4:
                return i
        return 100

    assert passes_to_follow(AdaptiveLength.memory) == passes_to_follow(1) < 40
    assert passes_to_follow(32 * 20 * 4) > 40  # a memory above 20 passes' betas would slow it


def test_a_draft_that_stops_on_its_own_is_modelled_by_how_often_it_goes_on():
    """k = 6 asked of a draft that stops after one token on 4 passes in 5 (a confidence stop):
    the policy measures that it goes on past the first position 1 time in 5 and past the others
    always, and predicts S from that (theory.capped_speedups), so a long cap costs only where
    the draft uses it. Positions asked for but not proposed are no news: their estimates (0.9
    where verified) keep their evidence; told nothing of the cap (the negative control), the
    policy fades them as positions not asked for, toward the first's 0.6."""
    from verispec.theory import capped_speedups

    def run(tell_cap: bool) -> AdaptiveLength:
        policy = AdaptiveLength(k_max=8)
        policy.seed_costs({n: 1.0 for n in range(1, 10)}, {(1, k): 0.15 * k for k in range(1, 9)})
        for i in range(400):
            k = 1 if i % 5 < 4 else 6
            betas = [0.6] + [0.9] * (k - 1)
            policy.observe(k, betas, [1] * k, 0.15 * k, 1.0, cap=6 if tell_cap else None)
        return policy

    policy = run(tell_cap=True)
    goes_on = policy.continues()
    assert goes_on[0] == pytest.approx(1.0) and goes_on[1] == pytest.approx(0.2, abs=0.08), goes_on
    assert min(goes_on[2:6]) > 0.97, goes_on
    alphas = policy.alphas()
    assert min(alphas[1:6]) > 0.85, alphas
    alphas_, c, r = policy._model_inputs()
    assert policy.predicted_speedups() == capped_speedups(alphas_, goes_on, c, r, 8)[0]
    assert policy.continues(batch=4)[1] == pytest.approx(1 - (1 - goes_on[1]) ** 4)  # not seen at 4 rows: all rows must stop
    blind = run(tell_cap=False)
    assert blind.continues()[1] == 1.0  # only ever told k = 1 or 6, all proposed
    assert max(blind.alphas()[1:6]) < 0.84, blind.alphas()
