"""The draft's proposal temperature (`verispec.proposal`) and its use by ModelDrafter.

- sharpen / acceptance_grid against their closed forms (q^(1/tau) renormalised; p(argmax q) at tau = 0).
- ProposalTemperature: picks the tau with the best acceptance, ties and no evidence at q, rows independent.
- Exactness: the joint distribution of three tokens under the processed target (chi-square at 1e-9) with a draft
  proposing at fixed taus and at auto, truncated and not; negative control: the rule told q while the proposal
  came from q sharpened (the distribution declared is not the one drawn from) fails.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import (
    JOINT_N,
    JOINT_PROMPT,
    JOINT_TOKENS,
    NEGATIVE_N,
    _assert_joint_fails,
    _joint_counts,
    _Settings,
    assert_joint_exact,
)

import verispec.proposal as proposal_module
from verispec.config import SamplingParams
from verispec.drafters.model import ModelDrafter
from verispec.proposal import TAUS, ProposalTemperature, acceptance_grid, sharpen, verified_positions
from verispec.rejection import acceptance_probability

pytestmark = pytest.mark.usefixtures("one_thread")


def _random_probs(shape, generator, zeros: bool = True) -> torch.Tensor:
    probs = torch.rand(shape, generator=generator) ** 3
    if zeros:
        probs[..., ::3] = 0.0  # a truncated support
    return probs / probs.sum(dim=-1, keepdim=True)


def test_sharpen_matches_the_closed_form():
    generator = torch.Generator().manual_seed(0)
    q = _random_probs((4, 3, 11), generator)
    assert torch.equal(sharpen(q, 1.0), q)
    for tau in (0.7, 0.5, 0.2):
        expected = q ** (1 / tau) / (q ** (1 / tau)).sum(dim=-1, keepdim=True)
        torch.testing.assert_close(sharpen(q, tau), expected, rtol=1e-5, atol=1e-7)
        assert bool((sharpen(q, tau)[q == 0] == 0).all())  # the support is kept
    one_hot = sharpen(q, 0.0)
    assert torch.equal(one_hot.argmax(dim=-1), q.argmax(dim=-1)) and torch.equal(one_hot.sum(dim=-1), torch.ones(4, 3))
    per_row = sharpen(q, torch.tensor([1.0, 0.5, 0.0, 0.2])[:, None])  # one tau per distribution
    for row, tau in enumerate((1.0, 0.5, 0.0, 0.2)):
        torch.testing.assert_close(per_row[row], sharpen(q[row], tau))


def test_sharpen_of_a_tiny_probability_stays_a_distribution():
    q = torch.tensor([[1e-30, 1e-35, 0.0]])
    q = q / q.sum()
    sharp = sharpen(q, 0.05)  # q**20 underflows in float32; computed from log(q / max q) it does not
    assert torch.isfinite(sharp).all() and abs(float(sharp.sum()) - 1) < 1e-6 and float(sharp[0, 0]) > 0.99


def test_acceptance_grid_is_the_acceptance_of_each_sharpened_proposal():
    generator = torch.Generator().manual_seed(1)
    q, p = _random_probs((3, 4, 13), generator), _random_probs((3, 5, 13), generator, zeros=False)
    grid = acceptance_grid(q, p)  # [B, k, G]
    assert grid.shape == (3, 4, len(TAUS))
    ids = torch.zeros(3, 4, dtype=torch.long)
    for g, tau in enumerate(TAUS):
        torch.testing.assert_close(grid[..., g], acceptance_probability(ids, sharpen(q, tau), p))
    argmax = q.argmax(dim=-1, keepdim=True)  # tau = 0: llama.cpp's greedy draft accepts p(argmax q)
    torch.testing.assert_close(grid[..., TAUS.index(0.0)], p[:, :4].gather(-1, argmax).squeeze(-1))


def test_verified_positions():
    assert verified_positions(torch.tensor([0, 2, 3]), 3).tolist() == [
        [True, False, False],
        [True, True, True],
        [True, True, True],
    ]


def _grid(best: int, batch: int = 2, k: int = 3) -> torch.Tensor:
    grid = torch.full((batch, k, len(TAUS)), 0.4)
    grid[..., best] = 0.6
    return grid


def test_auto_picks_the_tau_that_accepts_most_and_starts_at_q():
    proposal = ProposalTemperature()
    proposal.start(2)
    assert proposal.chosen().tolist() == [1.0, 1.0]  # no evidence: q itself
    every = torch.ones(2, 3, dtype=torch.bool)
    for _ in range(3):
        proposal.observe(_grid(TAUS.index(0.0)), every)
    assert proposal.chosen().tolist() == [0.0, 0.0]
    for _ in range(3 * 256):  # the evidence turns: the memory forgets the old positions
        proposal.observe(_grid(TAUS.index(0.5)), every)
    assert proposal.chosen().tolist() == [0.5, 0.5]
    assert proposal.summary()["tau"] == 0.5


def test_rows_choose_from_their_own_positions():
    proposal = ProposalTemperature()
    proposal.start(2)
    grid = torch.stack([_grid(TAUS.index(0.2), 1)[0], _grid(TAUS.index(0.7), 1)[0]])
    verified = torch.tensor([[True, True, False], [True, False, False]])
    proposal.observe(grid, verified)
    assert proposal.chosen().tolist() == pytest.approx([0.2, 0.7])
    proposal.add_rows(1)  # a new request knows nothing yet
    assert proposal.chosen().tolist() == pytest.approx([0.2, 0.7, 1.0])
    proposal.keep_rows([1, 2])
    assert proposal.chosen().tolist() == pytest.approx([0.7, 1.0])


def test_a_fixed_tau_stays_and_a_bad_one_is_refused():
    proposal = ProposalTemperature(0.5)
    proposal.start(3)
    assert proposal.chosen().tolist() == [0.5] * 3 and not proposal.auto
    for bad in (-0.1, 1.5, "x"):
        with pytest.raises(ValueError, match="draft temperature"):
            ProposalTemperature(bad)


TOPK = dict(temperature=0.7, top_k=3)
TRUNCATED = dict(temperature=1.0, top_k=4, top_p=0.9, min_p=0.1)


@pytest.mark.parametrize(
    "setting, tau",
    [
        pytest.param(dict(temperature=1.0), 0.5, id="T1-tau0.5"),
        pytest.param(TOPK, 0.0, id="topk-tau0"),
        pytest.param(TRUNCATED, 0.35, id="truncated-tau0.35"),
        pytest.param(TRUNCATED, None, id="truncated-auto"),
    ],
)
def test_joint_distribution_is_exact_at_every_proposal_temperature(markov, setting, tau, monkeypatch):
    """auto: with no confidence margin (Z = 0) rows switch tau on every pass's noise, each its own."""
    monkeypatch.setattr(proposal_module, "Z", 0.0)
    target, drafts = markov
    params = SamplingParams(**setting, seed=2000 + int(10 * (tau or 0)), max_new_tokens=JOINT_TOKENS)
    drafter = ModelDrafter(drafts["close"], draft_temperature=tau)
    assert_joint_exact(target, drafter, params, 2, JOINT_N, JOINT_PROMPT, label=f"{setting} tau={tau}")
    if tau is None:  # auto moved rows away from q: the choice was exercised, not only q
        assert bool((drafter.proposal.chosen() < 1).any())


class _DrawsSharper(_Settings):
    """The draft draws from q sharpened (tau 0.35) while the distribution it declares is q itself."""

    def draw(self, probs, positions, modes=("invariant", "rejection")):
        return self.real.draw(sharpen(probs, 0.35), positions, modes)


class _ProposesSharperThanDeclared(ModelDrafter):
    def propose(self, k, sampling):
        return super().propose(k, _DrawsSharper(sampling))


def test_negative_control_rule_told_q_while_proposal_came_from_a_sharper_q(markov):
    target, drafts = markov
    params = SamplingParams(**TRUNCATED, seed=7, max_new_tokens=JOINT_TOKENS)
    drafter = _ProposesSharperThanDeclared(drafts["close"], draft_temperature=1.0)
    counts, _ = _joint_counts(target, drafter, params, 2, NEGATIVE_N)
    _assert_joint_fails(counts, target.continuation_probs(JOINT_PROMPT, JOINT_TOKENS, params))


def test_the_summary_keeps_the_rows_that_left():
    proposal = ProposalTemperature()
    proposal.start(2)
    proposal.observe(
        torch.stack([_grid(TAUS.index(0.2), 1)[0], _grid(TAUS.index(0.2), 1)[0]]), torch.ones(2, 3, dtype=torch.bool)
    )
    proposal.keep_rows([])  # both requests finished
    summary = proposal.summary()
    assert summary["tau"] == 0.2 and summary["acceptance"][0.2] == pytest.approx(0.6)
    proposal.start(1)  # a new batch starts afresh
    assert proposal.summary() == {"tau": 1.0, "acceptance": {}}


def test_noise_does_not_move_a_row_off_q_and_a_real_gain_does():
    """Every tau accepts 0.5 on average with independent noise: a row stays at q (a choice by the mean alone
    leaves q in most rows: the control); a tau with a real gain of 0.1 is taken within 300 positions."""
    generator = torch.Generator().manual_seed(3)
    rows, positions = 400, 12
    proposal = ProposalTemperature()
    proposal.start(rows)
    for _ in range(positions // 3):
        proposal.observe(0.5 + 0.2 * torch.randn(rows, 3, len(TAUS), generator=generator), torch.ones(rows, 3).bool())
    left_q = float((proposal.chosen() != 1).double().mean())
    by_mean = float((proposal.estimates().argmax(dim=-1) != 0).double().mean())
    assert left_q < 0.05 and by_mean > 0.5, (left_q, by_mean)
    gain = torch.zeros(len(TAUS))
    gain[TAUS.index(0.5)] = 0.1
    proposal.start(rows)
    for _ in range(300 // 3):
        proposal.observe(
            0.5 + gain + 0.2 * torch.randn(rows, 3, len(TAUS), generator=generator), torch.ones(rows, 3).bool()
        )
    assert float((proposal.chosen() == 0.5).double().mean()) > 0.95
