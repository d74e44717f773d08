"""`verispec check` (verispec/check.py) and the chi-square it uses (verispec/chisquare.py).

- The threshold equals scipy's chi-square quantile; the detectable TV error shrinks as 1/sqrt(n).
- One position verified n times passes against p in both modes and with a deterministic
  drafter, and fails with the planted bug (recovered tokens drawn from p).
- On the toy pair the whole check passes (exit 0, every part, the negative control caught),
  for a draft model and prompt lookup; with a real bug in the rule it fails (exit 1).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import stats

from verispec import rejection
from verispec.analysis import check as check_module
from verispec.analysis.chisquare import chi_square, detectable_tv, threshold
from verispec.cli import main
from verispec.config import SamplingParams
from verispec.models.toy import make_toy_pair

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("df", [1, 2, 7, 100, 3000])
def test_threshold_is_scipys_chi_square_quantile(df):
    assert threshold(df) == pytest.approx(stats.chi2.isf(1e-9, df), rel=1e-9)
    assert threshold(df, 0.05) == pytest.approx(stats.chi2.isf(0.05, df), rel=1e-9)


def test_detectable_tv_shrinks_as_one_over_root_n():
    assert detectable_tv(400_000, 50) == pytest.approx(detectable_tv(100_000, 50) / 2)
    assert detectable_tv(10, 0) == float("inf")


def _pq(vocab: int = 40, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(vocab, generator=generator), -1)
    q = torch.softmax(2 * torch.randn(vocab, generator=generator), -1)
    return p, q


@pytest.mark.parametrize("mode", ["rejection", "invariant"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_one_position_verified_n_times_is_distributed_as_p(mode, deterministic):
    p, q = _pq()
    proposal = int(p.argmax())
    counts, accepted = check_module.verify_position(
        p, None if deterministic else q, proposal, SamplingParams(), 50_000, 1, mode
    )
    statistic, df = chi_square(counts, p.double().numpy())
    assert statistic <= threshold(df) and counts.sum() == 50_000
    if mode == "rejection":  # acceptance: p(x) for one-hot q, sum min(p, q) otherwise
        beta = float(p[proposal]) if deterministic else float(torch.minimum(p, q).sum())
        assert abs(accepted / 50_000 - beta) < 6 * np.sqrt(beta * (1 - beta) / 50_000)


def test_the_planted_bug_fails_the_same_test():
    p, q = _pq()
    with check_module._residual_from_p():
        counts, _ = check_module.verify_position(p, q, 0, SamplingParams(), 50_000, 2, "rejection")
    statistic, df = chi_square(counts, p.double().numpy())
    assert statistic > 3 * threshold(df)


def test_the_control_plants_the_bug_where_the_test_can_see_it():
    """A lookup's proposals at tokens of p near 0 (SmolLM2's prompt lookup: beta 0.000 at every position tested)
    leave the planted bug no room (TV beta (1 - beta) = 0): (d) then drafts from p on its most likely tokens, as many
    as make the bug show most after the test's pooling; before, it ran at the least accepted position and was not
    caught. A Zipf-shaped p over 50,000 tokens (most of its mass in cells pooled into one) too."""
    n = 20_000
    zipf = 1.0 / (torch.randperm(50_000, generator=torch.Generator().manual_seed(1)) + 10.0)
    for p in (_pq()[0], zipf / zipf.sum()):
        rare = int(p.argmin())  # beta = p(rare), near 0
        counts, accepted = check_module.verify_position(p, None, rare, SamplingParams(), n, 3, "rejection")
        test = check_module._test(0, 1, rare, p, None, counts, accepted, n)
        one_hot = torch.nn.functional.one_hot(torch.tensor(rare), p.shape[-1]).float()
        assert check_module._planted_tv(p, one_hot) < test.detectable_tv  # the drafter's proposal cannot show the bug
        report = check_module.CheckReport(settings={}, draws=n)
        check_module._control(report, [((0, 1, p, None, rare), test)], SamplingParams(), n, 0, print, lambda: None)
        control = report.control
        assert control["proposal"] is None and control["passed"]  # a q of its own, and the bug caught
        assert control["statistic"] > 2 * control["threshold"], control


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_pair(tmp_path_factory.mktemp("toy"))


def _check(toy, tmp_path, *extra):
    target, _ = toy
    out = tmp_path / "check.json"
    code = main(
        [
            "check",
            "--target",
            str(target),
            "--backend",
            "torch",
            "--draws",
            "20000",
            "--seeds",
            "16",
            "--k",
            "3",
            "--max-new-tokens",
            "12",
            "--json",
            str(out),
            *extra,
        ]
    )
    return code, json.loads(out.read_text())


@pytest.fixture(scope="module")
def retokenized(toy, tmp_path_factory):
    """The toy draft with another tokenizer (64 merges the target lacks, other ids)."""
    from toy_models import retokenized_draft

    text = "def f(x):\n    return x + 1\n\nimport os\nabc abd abc ab x = x + 1; " * 4
    return retokenized_draft(toy[1], tmp_path_factory.mktemp("retokenized") / "draft", text=text)


@pytest.mark.parametrize("draft", ["model", "ngram", "other-tokenizer"])
def test_the_check_passes_on_the_toy_pair(toy, tmp_path, capsys, draft, request):
    """'other-tokenizer': a draft of another vocabulary (token-level intersection)."""
    prompts = tmp_path / "prompts.jsonl"  # prompt lookup needs text that repeats: the third and fourth lines
    prompts.write_text(
        "".join(
            json.dumps({"prompt": text}) + "\n"
            for text in ["def f(x):", "import os", "abc abd abc ab", "x = x + 1; x = x + "]
        )
    )
    code, report = _check(
        toy,
        tmp_path,
        "--draft",
        {"model": str(toy[1]), "ngram": "ngram"}.get(draft) or str(request.getfixturevalue("retokenized")),
        "--prompts",
        str(prompts),
        "--temperature",
        "0.8",
        "--top-p",
        "0.95",
        "--contexts",
        "2",
    )
    printed = capsys.readouterr().out
    assert code == 0 and report["passed"] and "PASSED" in printed, printed
    assert len(report["tests"]) >= (1 if draft == "ngram" else 6) and all(t["passed"] for t in report["tests"])
    assert report["control"]["passed"] and report["control"]["planted_tv"] > 0
    assert report["invariant"] == {"rows": 16, "equal": 16, "near_ties": 0, "gaps": [], "passed": True}
    assert report["greedy"] == {"rows": 4, "equal": 4, "near_ties": 0, "gaps": [], "passed": True}
    assert report["deviation"]["largest"] >= 0 and report["deviation"]["contexts"] >= 1
    assert len({t["context"] for t in report["tests"]}) == 2


def test_greedy_rows_that_differ_beyond_the_measured_deviation_fail(toy, tmp_path, monkeypatch):
    """Greedy verification that commits the draft's token at the first rejection (a real bug):
    rows differ from plain decoding by logit gaps the engine's deviation cannot explain; (c) fails."""
    verify_greedy = rejection.verify_greedy

    def wrong(draft_token_ids, target_ids):
        output, accepted = verify_greedy(draft_token_ids, target_ids)
        rows = torch.arange(output.shape[0])
        rejected = accepted < draft_token_ids.shape[1]
        output[rows[rejected], accepted[rejected]] = draft_token_ids[rows[rejected], accepted[rejected]]
        return output, accepted

    monkeypatch.setattr(rejection, "verify_greedy", wrong)  # verify_batch reads it from its module
    code, report = _check(toy, tmp_path, "--draft", str(toy[1]), "--temperature", "0")
    assert code == 1 and not report["greedy"]["passed"]
    assert (
        report["greedy"]["equal"] < report["greedy"]["rows"]
        and min(report["greedy"]["gaps"]) > 2 * report["deviation"]["largest"]
    )


def test_the_check_fails_when_the_rule_is_wrong(toy, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(rejection, "_residual_probs", lambda draft_probs, target_probs: target_probs)
    code, report = _check(toy, tmp_path, "--draft", str(toy[1]))
    assert code == 1 and not report["passed"] and "FAILED" in capsys.readouterr().out
    assert not all(t["passed"] for t in report["tests"])


def test_invariant_rows_that_differ_by_more_than_a_near_tie_fail(toy, tmp_path, capsys, monkeypatch):
    """The target's invariant choices read at the wrong positions in speculative passes only (a
    real bug): rows differ, at gaps far above a floating-point near-tie, and (b) fails."""
    from verispec.sampling import RowSampling

    draw = RowSampling.draw
    monkeypatch.setattr(
        RowSampling,
        "draw",
        lambda self, probs, positions, modes=("invariant", "rejection"): draw(
            self, probs, positions + (positions.shape[1] > 1 and modes == ("invariant",)), modes
        ),
    )
    code, report = _check(toy, tmp_path, "--draft", str(toy[1]), "--sampling", "invariant")
    assert code == 1 and not report["invariant"]["passed"]
    movable = 4 * report["deviation"]["largest"] / report["settings"]["temperature"]
    assert report["invariant"]["equal"] < 16 and min(report["invariant"]["gaps"]) > movable


@pytest.mark.parametrize("tau", ["0.35", "auto"])
def test_the_check_tests_the_proposal_temperature_in_use(toy, tmp_path, capsys, tau):
    """(a) verifies q sharpened by the draft's proposal temperature: fixed, or auto's choice on the contexts."""
    from verispec.proposal import TAUS

    code, report = _check(
        toy, tmp_path, "--draft", str(toy[1]), "--temperature", "0.8", "--top-k", "5", "--draft-temperature", tau
    )
    printed = capsys.readouterr().out
    assert code == 0 and report["passed"], printed
    assert (
        report["proposal_tau"] == (0.35 if tau != "auto" else report["proposal_tau"]) and report["proposal_tau"] in TAUS
    )
    assert f"draft proposal temperature {report['proposal_tau']:g}" in printed
    betas = [t["beta"] for t in report["tests"]]
    assert report["control"]["passed"] and len(betas) >= 3


def test_a_time_limit_or_an_interrupt_prints_every_finished_step(toy, tmp_path, capsys, monkeypatch):
    """Cut in (b) by --max-seconds (the clock jumps once (d) is done) and in (c) by an interrupt: the finished steps
    are reported with a verdict on them, the rest named, and the JSON written. Without the fix no report came."""
    import verispec.analysis.check as check_module

    real_control, real_generate = check_module._control, check_module.generate_all

    def control_then_late(*args):  # (d) finishes, then the limit has passed
        real_control(*args)
        monkeypatch.setattr(check_module.time, "perf_counter", lambda: float("inf"))

    monkeypatch.setattr(check_module, "_control", control_then_late)
    code, report = _check(toy, tmp_path, "--draft", str(toy[1]), "--max-seconds", "600")
    out = capsys.readouterr().out
    assert code == 0 and report["passed"] and report["cut"] == "the time limit (--max-seconds 600)"
    assert report["finished"] == ["numerics", "(a)", "(d)"] and report["greedy"] is None and report["tests"]
    assert "PASSED what was checked" in out and "finished numerics, (a), (d); not finished (b), (c)" in out
    monkeypatch.undo()

    calls = []

    def interrupted(target, prompts, params, *rest, **kwargs):
        calls.append(params)
        if len(calls) == 6:  # the contexts, (b) in two blocks of plain and speculative rows, then (c): Ctrl-C
            raise KeyboardInterrupt
        return real_generate(target, prompts, params, *rest, **kwargs)

    monkeypatch.setattr(check_module, "generate_all", interrupted)
    code, report = _check(toy, tmp_path, "--draft", str(toy[1]), "--seeds", "50")
    assert report["cut"] == "an interrupt" and report["finished"] == ["numerics", "(a)", "(d)", "(b)"]
    assert report["invariant"]["rows"] == 50 and "cut by an interrupt" in capsys.readouterr().out
    assert main(["check", "--max-seconds", "0"]) == 2 and "--max-seconds must be > 0" in capsys.readouterr().err


def test_a_drafter_that_proposes_nothing_fails_the_check_in_one_line(toy, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(check_module, "_chain", lambda *args: ([], None, None))  # nothing proposed anywhere
    code, report = _check(toy, tmp_path, "--draft", "ngram")
    out = capsys.readouterr().out
    assert code == 1 and not report["passed"] and not report["tests"] and report["control"] is None
    assert report["skipped"] == [
        "(a), (d): the drafter proposed nothing after any of the 16 contexts; give --prompts whose continuations "
        "repeat text it can draft from"
    ]
    assert out.count("not tested:") == 1 and "FAILED" in out
