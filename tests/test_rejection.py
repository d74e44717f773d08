"""The accept-reject rule: every emitted token is distributed exactly as the target's p.

Statistical tests compare against the EXACT distribution with Pearson chi-square at a
false-failure rate of 1e-9 per assertion (tests/stats_helpers.py), N = 200,000 draws batched
as B = 200,000 rows. Draft tokens are always drawn from the declared q with `sample`.
Negative controls reproduce real bugs (REFERENCES.md) and must fail the same test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from stats_helpers import assert_distributed_as, counts_of, is_distributed_as

import verispec.rejection as rejection
from verispec.config import SamplingParams
from verispec.rejection import acceptance_probability, verify
from verispec.sampling import RowSampling, make_generator, process_logits, sample

N = 200_000


# --------------------------------------------------------------------------- helpers


def _dist(values) -> np.ndarray:
    """Normalised float64 distribution; tests compare against this exact vector."""
    values = np.asarray(values, dtype=np.float64)
    assert (values >= 0).all() and values.sum() > 0
    return values / values.sum()


def _dirichlet(seed: int, vocab: int, alpha: float = 1.0) -> np.ndarray:
    return _dist(np.random.default_rng(seed).dirichlet(np.full(vocab, alpha)))


def _one_hot(vocab: int, token: int) -> np.ndarray:
    out = np.zeros(vocab)
    out[token] = 1.0
    return out


def _t(probs: np.ndarray) -> torch.Tensor:
    return torch.tensor(np.asarray(probs), dtype=torch.float32)


def _run(p_rows, q_rows=None, *, proposals=None, seed=0, n=N):
    """Verify n identical rows.

    p_rows: k+1 target distributions [V]; q_rows: k draft distributions [V] (draft tokens are
    drawn from them with `sample`), or None for a deterministic drafter whose proposals are
    `proposals` (an int per position, or a LongTensor [n, k]).
    Returns (draft_token_ids, output_token_ids, num_accepted).
    """
    target = _t(np.stack(p_rows))  # [k+1, V]
    k, vocab = target.shape[0] - 1, target.shape[1]
    target_probs = target.expand(n, k + 1, vocab)
    if q_rows is not None:
        draft = _t(np.stack(q_rows)) if k else torch.zeros(0, vocab)
        draft_probs = draft.expand(n, k, vocab)
        draft_ids = sample(draft_probs, make_generator(seed))
    else:
        draft_probs = None
        if isinstance(proposals, torch.Tensor):
            draft_ids = proposals
        else:
            draft_ids = torch.tensor(list(proposals or []), dtype=torch.long).expand(n, k)
    assert draft_ids.shape == (n, k)
    output, num_accepted = verify(draft_ids, draft_probs, target_probs, make_generator(seed + 1))
    assert output.shape == (n, k + 1) and num_accepted.shape == (n,)
    return draft_ids, output, num_accepted


def _assert_rate(successes: int, trials: int, beta: float, label: str):
    rate = successes / trials
    se = math.sqrt(max(beta * (1 - beta), 0.0) / trials)
    assert abs(rate - beta) <= 6 * se + 1e-6, (
        f"{label}: empirical acceptance {rate:.5f} vs beta {beta:.5f} "
        f"({(rate - beta) / se if se else math.inf:+.1f} standard errors, n={trials})"
    )


# --------------------------------------------------------------------------- (p, q) pairs


def _pairs() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    pairs = {}
    pairs["random"] = (_dirichlet(1, 12), _dirichlet(2, 12))
    p = _dirichlet(5, 10)
    pairs["p_equals_q"] = (p, p.copy())
    pairs["disjoint_supports"] = (
        _dist([3, 1, 4, 1, 5, 9, 0, 0, 0, 0, 0, 0]),
        _dist([0, 0, 0, 0, 0, 0, 2, 6, 5, 3, 5, 8]),
    )
    pairs["one_hot_p"] = (_one_hot(12, 4), _dirichlet(6, 12))
    pairs["one_hot_q"] = (_dirichlet(7, 12), _one_hot(12, 4))
    pairs["one_hot_q_where_p_is_zero"] = (_dist([1, 2, 3, 0, 4, 5, 6, 7]), _one_hot(8, 3))
    p = _dirichlet(8, 12)
    p[[1, 5, 9]] = 0.0
    pairs["p_zero_where_q_positive"] = (_dist(p), _dirichlet(9, 12))
    q = _dirichlet(10, 12)
    q[[0, 2, 7]] = 0.0
    pairs["q_zero_where_p_positive"] = (_dirichlet(11, 12), _dist(q))
    p = _dist(np.arange(1, 17) + 4.0)  # smallest entry ~ 0.022, V = 16
    q = p.copy()
    q[[0, 1, 2, 3]] += [1e-3, -1e-3, 1.5e-3, -1.5e-3]  # sums to 1 still; TV(p, q) = 2.5e-3
    pairs["near_ties"] = (p, _dist(q))
    pairs["partial_overlap_sparse"] = (
        _dist([0, 5, 0, 1, 0, 0, 3, 0, 0, 2, 0, 0, 0, 0, 4, 0]),
        _dist([0, 1, 0, 6, 2, 0, 0, 0, 3, 2, 0, 0, 0, 0, 1, 0]),
    )
    return pairs


PAIRS = _pairs()


# k alternates between 1 and 2 over the pairs (each run costs ~0.7 s on two CPU cores)
PAIR_CASES = [(name, 1 + i % 2) for i, name in enumerate(PAIRS)]


@pytest.mark.parametrize(("name", "k"), PAIR_CASES, ids=[f"{n}-k{k}" for n, k in PAIR_CASES])
def test_first_token_is_distributed_as_p(name, k):
    p, q = PAIRS[name]
    vocab = p.size
    assert 8 <= vocab <= 16
    # later positions: some other fixed pair, so k = 2 exercises the full tensor path
    p_rows = [p] + [_dirichlet(100 + i, vocab) for i in range(k)]
    q_rows = [q] + [_dirichlet(200 + i, vocab) for i in range(k - 1)]
    draft_ids, output, num_accepted = _run(p_rows, q_rows, seed=10 * k + len(name))

    counts = counts_of(output[:, 0], vocab)
    assert counts[p == 0].sum() == 0, f"tokens with p = 0 emitted: {counts}"
    assert_distributed_as(counts, p, are_counts=True, label=f"{name}, k={k}")

    # the same draws: the acceptance rate of each position matches acceptance_probability
    beta = acceptance_probability(draft_ids[:1], _t(np.stack(q_rows))[None], _t(np.stack(p_rows))[None])[0]
    assert beta[0].item() == pytest.approx(np.minimum(p, q).sum(), abs=1e-6)
    _assert_rate(int((num_accepted >= 1).sum()), N, beta[0].item(), f"{name}, position 0")
    if k == 2 and (num_accepted >= 1).any():  # position 1, given position 0 accepted
        given = int((num_accepted >= 1).sum())
        _assert_rate(int((num_accepted >= 2).sum()), given, beta[1].item(), f"{name}, position 1 | 0 accepted")


# --------------------------------------------------------------------------- deterministic drafter

P_DET = _dist([0.05, 0.2, 0.0, 0.15, 0.1, 0.0, 0.3, 0.1, 0.05, 0.05])  # V = 10


@pytest.mark.parametrize(
    ("name", "p", "proposal", "k"),
    [
        ("typical_proposal", P_DET, 3, 1),
        ("proposal_is_argmax", P_DET, 6, 2),
        ("proposal_has_p_zero", P_DET, 2, 2),
        ("p_one_hot_at_proposal", _one_hot(10, 4), 4, 1),
        ("p_one_hot_elsewhere", _one_hot(10, 4), 7, 2),
    ],
)
def test_deterministic_drafter_first_token_is_distributed_as_p(name, p, proposal, k):
    p_rows = [p] + [_dirichlet(300 + i, 10) for i in range(k)]
    draft_ids, output, num_accepted = _run(p_rows, None, proposals=[proposal] + [1] * (k - 1), seed=k)
    counts = counts_of(output[:, 0], 10)
    assert counts[p == 0].sum() == 0, f"tokens with p = 0 emitted: {counts}"
    assert_distributed_as(counts, p, are_counts=True, label=f"{name}, k={k}")
    beta = acceptance_probability(draft_ids[:1], None, _t(np.stack(p_rows))[None])[0, 0].item()
    assert beta == pytest.approx(p[proposal], abs=1e-7)
    _assert_rate(int((num_accepted >= 1).sum()), N, beta, f"{name}, position 0")


def test_deterministic_drafter_random_proposals_is_exact():
    """q is one-hot at a different, random proposal in every row; the output is still p."""
    k = 2
    proposals = torch.randint(0, 10, (N, k), generator=make_generator(77))
    p_rows = [P_DET] + [_dirichlet(400 + i, 10) for i in range(k)]
    _, output, num_accepted = _run(p_rows, None, proposals=proposals, seed=5)
    assert_distributed_as(output[:, 0], P_DET, label="random proposals")
    # acceptance of position 0 is p at the row's proposal
    for token in range(10):
        rows = proposals[:, 0] == token
        _assert_rate(
            int((num_accepted[rows] >= 1).sum()),
            int(rows.sum()),
            float(P_DET[token]),
            f"random proposals, proposal {token}",
        )


# --------------------------------------------------------------------------- later positions


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft_probs", "draft_probs_None"])
def test_second_position_after_forced_acceptance_is_distributed_as_p2(deterministic):
    """p_1 = q_1 = one-hot at token 5: position 0 is always accepted, position 1 must be p_2."""
    vocab = 12
    p1 = _one_hot(vocab, 5)
    p2, q2 = _dirichlet(21, vocab), _dirichlet(22, vocab)
    p3 = _dirichlet(23, vocab)
    if deterministic:
        draft_ids, output, num_accepted = _run([p1, p2, p3], None, proposals=[5, 8], seed=3)
    else:
        draft_ids, output, num_accepted = _run([p1, p2, p3], [p1, q2], seed=3)
    assert (num_accepted >= 1).all()
    assert (output[:, 0] == 5).all()
    assert_distributed_as(output[:, 1], p2, label="position 1")


def test_second_position_conditional_on_first_acceptance_is_distributed_as_p2():
    vocab = 12
    p1, q1 = _dirichlet(31, vocab), _dirichlet(32, vocab)
    p2, q2 = _dirichlet(33, vocab), _dist(_dirichlet(34, vocab) + np.eye(vocab)[2])
    p3 = _dirichlet(35, vocab)
    _, output, num_accepted = _run([p1, p2, p3], [p1 * 0.5 + q1 * 0.5, q2], seed=4)
    kept = output[num_accepted >= 1, 1]
    assert kept.numel() > N // 3  # beta_0 = sum min(p1, (p1 + q1) / 2) >= 0.5
    assert_distributed_as(kept, p2, label="position 1 | position 0 accepted")


@pytest.mark.parametrize("k", [2])
def test_bonus_token_after_all_accepted_is_distributed_as_p_k_plus_1(k):
    vocab = 9
    p_rows = [_one_hot(vocab, 2 + i) for i in range(k)] + [_dirichlet(41, vocab)]
    q_rows = [_one_hot(vocab, 2 + i) for i in range(k)]
    _, output, num_accepted = _run(p_rows, q_rows, seed=6)
    assert (num_accepted == k).all()
    assert (output[:, :k] == torch.arange(2, 2 + k)).all()
    assert_distributed_as(output[:, k], p_rows[k], label=f"bonus token, k={k}")


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["draft_probs_None", "draft_probs_empty"])
def test_k_zero_output_is_one_sample_from_target(with_draft_probs):
    p = _dirichlet(51, 11)
    p[3] = 0.0
    p = _dist(p)
    draft_ids, output, num_accepted = _run([p], [] if with_draft_probs else None, proposals=[], seed=8)
    assert draft_ids.shape == (N, 0)
    assert output.shape == (N, 1) and output.dtype == torch.long
    assert (num_accepted == 0).all()
    assert_distributed_as(output[:, 0], p, label="k = 0")


# --------------------------------------------------------------------------- negative controls
# Each scenario: the correct version passes, the buggy one fails the same test at the same N.

NEG_P = _dist([0.4, 0.3, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0])
NEG_Q = _dist([0.05, 0.05, 0.1, 0.1, 0.3, 0.3, 0.1, 0.0])


def test_control_a_residual_correct_passes():
    _, output, _ = _run([NEG_P, _dirichlet(61, 8)], [NEG_Q], seed=11)
    assert_distributed_as(output[:, 0], NEG_P)


def test_control_a_resampling_from_p_instead_of_residual_fails(monkeypatch):
    monkeypatch.setattr(rejection, "_residual_probs", lambda draft_probs, target_probs: target_probs)
    _, output, _ = _run([NEG_P, _dirichlet(61, 8)], [NEG_Q], seed=11)
    assert not is_distributed_as(output[:, 0], NEG_P)
    # and it fails for the reason expected: the output is min(p, q) + (1 - beta) p
    beta = np.minimum(NEG_P, NEG_Q).sum()
    assert_distributed_as(output[:, 0], np.minimum(NEG_P, NEG_Q) + (1 - beta) * NEG_P)


# draft top-3 = {0, 1, 2} (holding about half of the softmax mass), target top-3 = {0, 1, 3}
DRAFT_LOGITS = torch.tensor([1.2, 1.0, 1.1, 0.0, -0.1, 0.1, 0.05, -0.2, 0.0, 0.15, -0.05, 0.02])
TARGET_LOGITS = torch.tensor([0.0, 0.1, -1.0, 1.2, -0.5, -0.3, -2.0, -0.4, -1.5, -0.6, -0.8, -1.1])
TOP_K = SamplingParams(top_k=3)


def _control_b(declared_q: torch.Tensor, seed: int = 12):
    sampled_q = process_logits(DRAFT_LOGITS, TOP_K)  # the draft token really comes from this
    p = process_logits(TARGET_LOGITS, TOP_K)
    draft_ids = sample(sampled_q.expand(N, 1, 12), make_generator(seed))
    target_probs = torch.stack([p, p]).expand(N, 2, 12)
    output, _ = verify(draft_ids, declared_q.expand(N, 1, 12), target_probs, make_generator(seed + 1))
    return output[:, 0], p.double().numpy()


def test_control_b_declared_q_is_the_processed_q_passes():
    first, p = _control_b(process_logits(DRAFT_LOGITS, TOP_K))
    assert set(np.nonzero(p)[0].tolist()) == {0, 1, 3}
    assert_distributed_as(first, p)


def test_control_b_q_declared_from_raw_logits_fails():
    raw_q = torch.softmax(DRAFT_LOGITS, dim=-1)
    first, p = _control_b(raw_q)
    # the exact (wrong) output distribution, to check that the failure is large
    q_true = process_logits(DRAFT_LOGITS, TOP_K).double().numpy()
    q_decl = raw_q.double().numpy()
    accept = np.minimum(1.0, np.divide(p, q_decl))
    accepted = q_true * accept
    residual = np.clip(p - q_decl, 0, None)
    wrong = accepted + (1 - accepted.sum()) * residual / residual.sum()
    assert 0.5 * np.abs(wrong - p).sum() > 0.1
    assert not is_distributed_as(first, p)
    assert_distributed_as(first, wrong)


TEMP_TARGET_LOGITS = torch.tensor([3.0, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
TEMP_DRAFT_LOGITS = torch.tensor([2.0, 2.5, 1.0, 1.2, 0.0, 0.3, -1.0, 0.0, -1.0, -2.0])
HALF = SamplingParams(temperature=0.5)


def _control_c(target_params: SamplingParams, seed: int = 13):
    q = process_logits(TEMP_DRAFT_LOGITS, HALF)  # the draft is processed as the request asks
    p = process_logits(TEMP_TARGET_LOGITS, target_params)
    draft_ids = sample(q.expand(N, 1, 10), make_generator(seed))
    output, _ = verify(draft_ids, q.expand(N, 1, 10), torch.stack([p, p]).expand(N, 2, 10), make_generator(seed + 1))
    expected = process_logits(TEMP_TARGET_LOGITS.double(), HALF).double().numpy()  # what was asked
    return output[:, 0], expected


def test_control_c_target_at_requested_temperature_passes():
    first, expected = _control_c(HALF)
    assert_distributed_as(first, expected)


def test_control_c_target_left_at_temperature_one_fails():
    first, expected = _control_c(SamplingParams(temperature=1.0))
    t1 = process_logits(TEMP_TARGET_LOGITS, SamplingParams()).double().numpy()
    assert 0.5 * np.abs(t1 - expected).sum() > 0.1
    assert not is_distributed_as(first, expected)
    assert_distributed_as(first, t1)


# --------------------------------------------------------------------------- greedy reduction


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft_probs", "draft_probs_None"])
def test_greedy_reduces_to_prefix_match_then_argmax(deterministic):
    batch, k, vocab = 4096, 4, 16
    gen = make_generator(2024)
    target_logits = torch.randn(batch, k + 1, vocab, generator=gen)
    target_probs = process_logits(target_logits, SamplingParams(temperature=0))
    argmax = target_logits.argmax(-1)  # [B, k+1]
    random_tokens = torch.randint(0, vocab, (batch, k), generator=gen)
    match = torch.rand(batch, k, generator=gen) < 0.8
    draft_ids = torch.where(match, argmax[:, :k], random_tokens)
    draft_probs = None
    if not deterministic:  # random q, positive everywhere, so the draft token has q > 0
        draft_probs = torch.softmax(2 * torch.randn(batch, k, vocab, generator=gen), dim=-1)

    output, num_accepted = verify(draft_ids, draft_probs, target_probs, make_generator(1))

    equal = (draft_ids == argmax[:, :k]).long()
    expected_n = equal.cumprod(dim=1).sum(dim=1)
    assert torch.equal(num_accepted, expected_n)
    assert set(expected_n.tolist()) == set(range(k + 1))  # every prefix length occurs
    positions = torch.arange(k + 1)
    padded = torch.cat([draft_ids, torch.full((batch, 1), -1)], dim=1)
    expected = torch.where(positions < expected_n[:, None], padded, -1)
    expected[torch.arange(batch), expected_n] = argmax[torch.arange(batch), expected_n]
    assert torch.equal(output, expected)


# --------------------------------------------------------------------------- shapes and contract


def _random_batch(seed: int, batch: int, k: int, vocab: int, deterministic: bool):
    gen = make_generator(seed)
    target_logits = 2 * torch.randn(batch, k + 1, vocab, generator=gen)
    target_probs = process_logits(target_logits, SamplingParams(top_k=5))
    if deterministic:  # mostly the target's argmax (so long accepted runs occur), else any token
        draft_probs = None
        random_ids = torch.randint(0, vocab, (batch, k), generator=gen)
        use_argmax = torch.rand(batch, k, generator=gen) < 0.9
        draft_ids = torch.where(use_argmax, target_logits[:, :k].argmax(-1), random_ids)
    else:
        draft_probs = process_logits(2 * torch.randn(batch, k, vocab, generator=gen), SamplingParams(top_p=0.8))
        draft_ids = sample(draft_probs, gen)
    return draft_ids, draft_probs, target_probs


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft_probs", "draft_probs_None"])
@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_output_contract(k, deterministic):
    batch, vocab = 3000, 10
    draft_ids, draft_probs, target_probs = _random_batch(k + 17, batch, k, vocab, deterministic)
    inputs = [t.clone() for t in (draft_ids, target_probs) + ((draft_probs,) if draft_probs is not None else ())]

    output, num_accepted = verify(draft_ids, draft_probs, target_probs, make_generator(3))

    assert output.shape == (batch, k + 1) and output.dtype == torch.long
    assert num_accepted.shape == (batch,) and num_accepted.dtype == torch.long
    assert (num_accepted >= 0).all() and (num_accepted <= k).all()
    for before, after in zip(inputs, (draft_ids, target_probs, draft_probs)):
        assert torch.equal(before, after), "verify modified an input"
    rows = torch.arange(batch)
    positions = torch.arange(k + 1)
    accepted_part = positions[None, :] < num_accepted[:, None]
    padded = torch.cat([draft_ids, torch.full((batch, 1), -1)], dim=1)
    assert torch.equal(output[accepted_part], padded[accepted_part])
    assert (output[positions[None, :] > num_accepted[:, None]] == -1).all()
    extra = output[rows, num_accepted]
    assert ((extra >= 0) & (extra < vocab)).all()
    # the extra token is possible under its distribution: p > 0 (bonus), p > q (recovered)
    p_extra = target_probs[rows, num_accepted, extra]
    assert (p_extra > 0).all()
    rejected = num_accepted < k
    if rejected.any():
        r_rows, r_pos = rows[rejected], num_accepted[rejected]
        if draft_probs is None:
            assert (extra[rejected] != draft_ids[r_rows, r_pos]).all()
        else:
            assert (p_extra[rejected] > draft_probs[r_rows, r_pos, extra[rejected]]).all()
    if k:
        assert set(num_accepted.tolist()) == set(range(k + 1))  # the test exercises every case


def test_same_generator_seed_same_output():
    draft_ids, draft_probs, target_probs = _random_batch(5, 500, 3, 10, deterministic=False)
    a = verify(draft_ids, draft_probs, target_probs, make_generator(9))
    b = verify(draft_ids, draft_probs, target_probs, make_generator(9))
    c = verify(draft_ids, draft_probs, target_probs, make_generator(10))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


# --------------------------------------------------------------------------- acceptance probability


def test_acceptance_probability_is_sum_of_min():
    draft_ids, draft_probs, target_probs = _random_batch(31, 64, 3, 10, deterministic=False)
    beta = acceptance_probability(draft_ids, draft_probs, target_probs)
    expected = np.minimum(target_probs[:, :3].double().numpy(), draft_probs.double().numpy()).sum(-1)
    assert beta.shape == (64, 3)
    np.testing.assert_allclose(beta.double().numpy(), expected, atol=1e-6)
    # also with target_probs [B, k, V]
    torch.testing.assert_close(acceptance_probability(draft_ids, draft_probs, target_probs[:, :3]), beta)
    # 1 - TV
    tv = 0.5 * np.abs(target_probs[:, :3].double().numpy() - draft_probs.double().numpy()).sum(-1)
    np.testing.assert_allclose(beta.double().numpy(), 1 - tv, atol=1e-6)


def test_acceptance_probability_deterministic_drafter_is_p_at_proposal():
    draft_ids, _, target_probs = _random_batch(32, 64, 3, 10, deterministic=True)
    beta = acceptance_probability(draft_ids, None, target_probs)
    expected = target_probs[:, :3].gather(-1, draft_ids[..., None]).squeeze(-1)
    assert beta.shape == (64, 3)
    assert torch.equal(beta, expected)
    assert (beta == 0).any()  # top_k = 5 of 10: some proposals have p = 0


@pytest.mark.parametrize("declared_q", ["one-hot", "soft", "none"])
def test_greedy_rule_on_token_ids_equals_the_general_rule(declared_q):
    """verify_batch at temperature 0 (verify_greedy on the target's argmax ids, which
    step.score hands it, and beta = q(argmax)) gives the general rule's output, acceptance
    count and beta on one-hot p, whatever q is declared."""
    from verispec.rejection import verify_batch

    generator = torch.Generator().manual_seed(3)
    batch, k, vocab = 64, 4, 7
    logits = torch.randn(batch, k + 1, vocab, generator=generator) * 2
    argmax = logits.argmax(-1)
    # proposals that often equal the argmax, so every acceptance count 0..k occurs
    draft = torch.where(
        torch.rand(batch, k, generator=generator) < 0.7,
        argmax[:, :k],
        torch.randint(vocab, (batch, k), generator=generator),
    )
    if declared_q == "one-hot":
        q = torch.nn.functional.one_hot(draft, vocab).float()
    elif declared_q == "soft":  # any q: with one-hot p the outcome never depends on it
        q = torch.softmax(torch.randn(batch, k, vocab, generator=generator), -1).scatter(-1, draft[..., None], 0.5)
        q = q / q.sum(-1, keepdim=True)
    else:
        q = None
    params = SamplingParams(temperature=0)
    output, accepted, beta, _ = verify_batch(argmax, draft, q, RowSampling(params, batch), [0] * batch)
    p = process_logits(logits, params)
    expected_output, expected_accepted = verify(draft, q, p, generator)
    assert torch.equal(output, expected_output) and torch.equal(accepted, expected_accepted)
    assert torch.allclose(beta, acceptance_probability(draft, q, p))
    assert set(accepted.tolist()) == set(range(k + 1))
