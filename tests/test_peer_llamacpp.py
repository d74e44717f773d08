"""`bench --peer llamacpp` at T > 0, without llama.cpp's programs: the sampling flags built for
`llama-speculative-simple` and the chain built for llama-cpp-python sample verispec's distribution
(each chain run on llama.cpp's own samplers and compared with `sampling.process_logits`; llama.cpp's
default orders, temperature last, are the negative controls), the --seed list, the (prompt, seed)
pairs in their order, and the report's medians, per-pair ratios, acceptance and proposal temperatures."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from verispec.analysis import llamacpp_program as lp
from verispec.analysis.peer_llamacpp import interleave, pair_order
from verispec.analysis.peer_report import PLAIN, report
from verispec.cli import main, reports
from verispec.cli.common import seeds
from verispec.config import SamplingParams
from verispec.sampling import process_logits
from verispec.stats import RequestStats, SpecStats

SPEC = "llama.cpp speculative k=4 (llama-speculative-simple)"
TRUNCATED = dict(top_k=40, top_p=0.95, min_p=0.05)  # llama.cpp's defaults
SETTINGS = [
    SamplingParams(temperature=1.0, **TRUNCATED),
    SamplingParams(temperature=0.8, **TRUNCATED),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_p=0.8),
    SamplingParams(temperature=1.7, min_p=0.1),
    SamplingParams(temperature=0.7, top_k=5),
]
# where the order matters (T != 1 with top-p or min-p), so that the default orders must fail there
ORDER_MATTERS = [SamplingParams(temperature=0.8, **TRUNCATED), SamplingParams(temperature=0.6, top_p=0.8)]


def _line(params: SamplingParams, tmp_path) -> list[str]:
    return lp.command(
        tmp_path / lp.PROGRAM, tmp_path / "t.gguf", "def f():", 16, params, 2, 256, draft=tmp_path / "d.gguf", k=4
    )


def _flag(line: list[str], flag: str) -> str:
    assert line.count(flag) == 1, line
    return line[line.index(flag) + 1]


def test_the_programs_sampling_flags_are_verispecs_settings_in_verispecs_order(tmp_path):
    line = _line(SamplingParams(temperature=0.8, seed=3, **TRUNCATED), tmp_path)
    assert [_flag(line, f) for f in ("--temp", "--top-k", "--top-p", "--min-p", "-s")] == [
        "0.8",
        "40",
        "0.95",
        "0.05",
        "3",
    ]
    assert _flag(line, "--samplers") == "top_k;temperature;top_p;min_p"  # temperature before top-p and min-p
    plain = _line(SamplingParams(temperature=1.0, seed=0), tmp_path)
    assert _flag(plain, "--samplers") == "temperature"  # no penalties, DRY, XTC, typical-p: the list is the chain
    assert [_flag(plain, f) for f in ("--top-k", "--top-p", "--min-p")] == ["0", "1.0", "0.0"]
    greedy = _line(SamplingParams(temperature=0.0, top_p=0.5, seed=0), tmp_path)
    assert _flag(greedy, "--temp") == "0.0" and _flag(greedy, "--samplers") == "temperature;top_p"
    for seed in (None, lp.SEED_LIMIT):  # no seed, and the one llama.cpp reads as "random"
        with pytest.raises(ValueError, match=r"llama.cpp's seeds are integers in \[0, 2\*\*32 - 1\)"):
            _line(SamplingParams(temperature=1.0, seed=seed), tmp_path)


def _logits(vocab: int = 256, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * 2).astype(np.float32)


def _applied(chain, logits: np.ndarray) -> np.ndarray:
    """The distribution a llama.cpp sampler chain leaves over `logits`: softmax of the surviving candidates' logits."""
    import llama_cpp as lc

    data = (lc.llama_token_data * len(logits))(*(lc.llama_token_data(i, float(x), 0.0) for i, x in enumerate(logits)))
    candidates = lc.llama_token_data_array(data, len(logits), -1, False)
    lc.llama_sampler_apply(chain, ctypes.byref(candidates))
    ids = [data[i].id for i in range(candidates.size)]
    kept = np.array([data[i].logit for i in range(candidates.size)], dtype=np.float64)
    probs = np.zeros(len(logits))
    probs[ids] = np.exp(kept - kept.max()) / np.exp(kept - kept.max()).sum()
    return probs


def _program_chain(names: list[str], line: list[str]):
    """llama.cpp's samplers, as the program builds them from its flags (common/sampling.cpp), in the order `names`."""
    import llama_cpp as lc

    make = {
        "top_k": lambda: lc.llama_sampler_init_top_k(int(_flag(line, "--top-k"))),
        "temperature": lambda: lc.llama_sampler_init_temp_ext(float(_flag(line, "--temp")), 0.0, 1.0),
        "top_p": lambda: lc.llama_sampler_init_top_p(float(_flag(line, "--top-p")), 0),
        "min_p": lambda: lc.llama_sampler_init_min_p(float(_flag(line, "--min-p")), 0),
    }
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    for name in names:
        lc.llama_sampler_chain_add(chain, make[name]())
    return chain


def _verispec(params: SamplingParams, logits: np.ndarray) -> np.ndarray:
    return process_logits(torch.from_numpy(logits), params).double().numpy()


def test_the_programs_chain_samples_verispecs_distribution_and_its_default_order_does_not(tmp_path):
    pytest.importorskip("llama_cpp")
    for params in SETTINGS:
        line = _line(dataclasses.replace(params, seed=0), tmp_path)
        for seed in range(3):
            logits = _logits(seed=seed)
            chain = _program_chain(_flag(line, "--samplers").split(";"), line)
            assert np.abs(_applied(chain, logits) - _verispec(params, logits)).max() < 1e-5, params
    for params in ORDER_MATTERS:  # negative control: the program's default order, temperature last
        line = _line(dataclasses.replace(params, seed=0), tmp_path)
        default = [n for n in ("top_k", "top_p", "min_p", "temperature") if n in _flag(line, "--samplers").split(";")]
        logits = _logits()
        assert np.abs(_applied(_program_chain(default, line), logits) - _verispec(params, logits)).max() > 1e-3


def test_llama_cpp_pythons_chain_samples_verispecs_distribution_and_its_own_does_not():
    pytest.importorskip("llama_cpp")
    from llama_cpp import Llama

    from verispec.analysis.peer_llamacpp import ordered_sampler

    for params in SETTINGS:
        logits = _logits(seed=1)
        chain = ordered_sampler(params, seed=0)
        assert np.abs(_applied(chain.sampler, logits) - _verispec(params, logits)).max() < 1e-5, params
    logits = _logits(seed=1)
    greedy = ordered_sampler(SamplingParams(temperature=0.0), seed=0)
    assert _applied(greedy.sampler, logits).argmax() == logits.argmax()
    fake = SimpleNamespace(_n_vocab=len(logits), last_n_tokens_size=64, _seed=0, _model=None)
    for params in ORDER_MATTERS:  # negative control: llama-cpp-python's own chain (top-k, ..., temperature last)
        own = Llama._init_sampler(
            fake, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p, temp=params.temperature
        )
        assert np.abs(_applied(own.sampler, logits) - _verispec(params, logits)).max() > 1e-3


def test_bench_seed_takes_a_list():
    assert seeds("0,1,2") == [0, 1, 2] and seeds(" 3, 1,3") == [3, 1] and seeds("7") == [7]
    for bad in ("", "0,", "x", "-1", "1.5", str(2**63)):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated integers"):
            seeds(bad)


def test_pairs_run_seed_by_seed_and_every_system_on_each_pair_in_turn():
    assert pair_order(2, [5, 6, 5]) == [(0, 5), (1, 5), (0, 6), (1, 6)]
    calls = []
    systems = {name: (lambda i, seed, name=name: calls.append((name, i, seed)) or {"i": i}) for name in "ab"}
    results = interleave(systems, pair_order(2, [5, 6]), repeats=2)
    one_round = [(name, i, seed) for seed in (5, 6) for i in (0, 1) for name in "ab"]
    assert calls == one_round * 2
    assert [[len(runs) for runs in results[name]] for name in "ab"] == [[2] * 4] * 2
    assert [runs[0]["i"] for runs in results["a"]] == [0, 1, 0, 1]


def _verispec_run(seconds: float, proposed: int, accepted: int, proposal: dict | None) -> dict:
    request = RequestStats(generated_tokens=60)
    for _ in range(proposed // 4):
        request.observe(4, accepted * 4 // proposed, [0.5] * 4)
    stats = SpecStats()
    stats.add(request)
    run = {"tokens": [1] * 60, "decoded": 60, "seconds": seconds, "stats": stats, "proposal": proposal}
    return {**run, "inside": seconds / 2, "target": seconds / 2}  # as much time outside llama.cpp as inside


def _results() -> dict[str, list[list[dict]]]:
    """Three pairs, two rounds each: tokens/s per pair llama.cpp plain 10, 10, 10; its speculative 20, 10, 40;
    verispec 10, 40, 30 (medians 20 and 30, but the median of per-pair ratios 0.75). verispec accepts 8 of 8
    proposals on pair 0 (ending on tau 0.5), 4 of 8 on the others (ending on tau 0); llama.cpp 5 of 10, and
    drafts nothing on pair 2."""
    taus = [{"tau": 0.5, "acceptance": {1.0: 0.3, 0.5: 0.4}}, {"tau": 0.0, "acceptance": {1.0: 0.5, 0.5: 0.6}}]
    verispec = [
        [_verispec_run(60 / speed, 8, accepted, taus[pair > 0]) for _ in range(2)]
        for pair, (speed, accepted) in enumerate([(10, 8), (40, 4), (30, 4)])
    ]
    spec = [
        [{"text": "x", "decoded": 60, "seconds": 60 / speed, "drafted": drafted, "accepted": drafted // 2}] * 2
        for speed, drafted in [(20, 10), (10, 10), (40, 0)]
    ]
    plain = [[{"tokens": [1] * 60, "decoded": 60, "seconds": 6.0}] * 2 for _ in range(3)]
    return {PLAIN: plain, "verispec k=4": verispec, SPEC: spec}


HEADER = dict(
    temperature=0.8,
    top_k=40,
    top_p=0.95,
    min_p=0.05,
    llama_cpp_samplers="top_k;temperature;top_p;min_p",
    prompts=3,
    seeds=[0],
    pairs=3,
    threads=2,
    target_description="t",
    draft_description="d",
    compiled_step="step",
    ngram_draft_lengths=[],
)


def test_the_report_takes_medians_over_pairs_and_of_per_pair_ratios():
    result = report(_results(), pair_order(3, [0]), tokenizer=None, header=dict(HEADER))
    rows = {row["system"]: row for row in result["runs"]}
    verispec, spec = rows["verispec k=4"], rows[SPEC]
    assert verispec["tokens_per_s"] == pytest.approx(30) and spec["tokens_per_s"] == pytest.approx(20)
    assert result["llamacpp_speculative_best"] == SPEC
    assert verispec["vs_llamacpp_speculative_best"] == pytest.approx(0.75)  # not 30 / 20
    assert verispec["vs_llamacpp_speculative_best_range"] == pytest.approx([0.5, 4.0])
    assert spec["vs_llamacpp_speculative_best"] == 1.0 and rows[PLAIN]["vs_llamacpp_plain"] == 1.0
    assert spec["alpha_hat"] == pytest.approx(20 / 40) and spec["alpha_hat_range"] == pytest.approx([0.5, 0.5])
    assert verispec["alpha_hat"] == pytest.approx((16 + 8 + 8) / 48)  # pooled over every run
    assert verispec["alpha_hat_range"] == pytest.approx([0.5, 1.0]) and "alpha_hat" not in rows[PLAIN]
    assert verispec["own_share_of_target_pass"] == pytest.approx(1.0)
    assert verispec["proposal_tau"] == {"0": 4, "0.5": 2}  # the tau each run ended on, most common first
    assert verispec["proposal_acceptance"] == pytest.approx({"0.5": (0.8 + 2.4) / 6, "1": (0.6 + 2.0) / 6})
    assert "identical_prompts" not in verispec  # sampled: no identity to check
    json.dumps(result)
    lines = reports.peer_llamacpp_lines(result, 64, 2, 0.0)
    assert any("0.75 [0.50,4.00]" in line and line.strip().startswith("verispec k=4") for line in lines)
    assert "T=0.8, top-k 40, top-p 0.95, min-p 0.05" in lines[-1] and "top_k;temperature;top_p;min_p" in lines[-1]
    assert any(line.startswith("verispec k=4: proposal temperature") for line in lines)


def test_a_chained_ngram_and_draft_counts_as_llamacpps_speculative_not_as_an_ngram_drafter():
    from verispec.analysis.llamacpp_program import ngram_system

    results = _results()

    def runs(speed: float) -> list[list[dict]]:
        return [[{"text": "x", "decoded": 60, "seconds": 60 / speed, "drafted": 4, "accepted": 2}] * 2] * 3

    chain, lone = "ngram-mod,draft-simple k=4", "ngram-mod"
    results[ngram_system(lone, 16)], results[ngram_system(chain, 16)] = runs(25), runs(50)
    sweeps = {ngram_system(lone, 16): (lone, 16), ngram_system(chain, 16): (chain, 16)}
    result = report(results, pair_order(3, [0]), tokenizer=None, header=dict(HEADER), sweeps=sweeps)
    rows = {row["system"].split(" n=")[0]: row for row in result["runs"]}
    assert result["llamacpp_speculative_best"].startswith(f"llama.cpp {chain} n=16")  # 50 tokens/s: its best
    assert rows[f"llama.cpp {chain}"]["vs_llamacpp_ngram_best"] == pytest.approx(2.0)  # over ngram-mod alone
    assert rows["verispec k=4"]["vs_llamacpp_speculative_best"] == pytest.approx(30 / 50)  # median of 10, 40, 30


def test_greedy_reports_identity_per_pair():
    results = _results()
    results[PLAIN][1][-1] = dict(results[PLAIN][1][-1], tokens=[2] * 60)  # pair 1's last round differs
    del results[SPEC]

    result = report(results, pair_order(3, [0]), tokenizer=None, header=dict(HEADER, temperature=0.0))
    verispec = next(row for row in result["runs"] if row["system"] == "verispec k=4")
    assert verispec["identical_to_llamacpp_plain"] is False and verispec["identical_prompts"] == 2
    assert verispec["vs_llamacpp_speculative_best"] is None and result["llamacpp_speculative_best"] is None
    assert "greedy (T=0)" in reports.peer_llamacpp_lines(result, 64, 2, 0.0)[-1]


def test_bench_peer_llamacpp_passes_its_sampling_settings_and_seeds(tmp_path, monkeypatch, capsys):
    from verispec import assemble
    from verispec.analysis import peer_llamacpp

    given = {}

    def fake_run(target, draft, texts, ks, max_new_tokens, repeats, sampling, seeds, *rest, **options):
        given.update(sampling=sampling, seeds=seeds, ks=ks, draft_temperature=options["draft_temperature"])
        return report(_results(), pair_order(3, [0]), None, dict(HEADER))

    monkeypatch.setattr(peer_llamacpp, "run_llamacpp_peer_bench", fake_run)
    monkeypatch.setattr(assemble, "gguf_files", lambda settings, drafts: ("t.gguf", ["d.gguf"]))
    monkeypatch.setattr(assemble, "llamacpp_unavailable", lambda: None)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n')
    flags = ["--temperature", "0.8", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.05", "--seed", "0,1,1,2"]
    peer = ["bench", "--peer", "llamacpp", "--prompts", str(prompts), "--k", "4"]
    assert main([*peer, *flags]) == 0
    sampling = SamplingParams(temperature=0.8, **TRUNCATED)
    assert given == dict(sampling=sampling, seeds=[0, 1, 2], ks=[4], draft_temperature=None)  # auto
    assert "vs llama.cpp spec best" in capsys.readouterr().out
    assert main([*peer, *flags, "--draft-temperature", "0.35"]) == 0 and given["draft_temperature"] == 0.35


def test_draft_temperature_is_auto_or_a_number_in_0_1():
    from verispec.cli.common import draft_temperature

    assert draft_temperature("auto") is None and draft_temperature("0") == 0.0 and draft_temperature("1") == 1.0
    for bad in ("", "1.5", "-0.1", "nan", "sharp"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be 'auto' or a number in"):
            draft_temperature(bad)


def test_the_proposal_temperature_of_a_model_draft_alone_or_combined():
    """The run's proposal temperature is read from the model drafter, alone or inside a combined draft,
    after its rows left; nothing for a drafter without one."""
    from verispec.analysis.peer_llamacpp import _proposal
    from verispec.drafters.combined import CombinedDrafter
    from verispec.drafters.model import ModelDrafter
    from verispec.drafters.suffix import SuffixDrafter
    from verispec.proposal import TAUS

    for make in (lambda d: d, lambda d: CombinedDrafter(SuffixDrafter(), d)):
        model = ModelDrafter(torch.nn.Identity(), 0.0, None)
        model.proposal.start(1)
        grid = torch.tensor(TAUS, dtype=torch.float32).flip(0)[None, None, :].expand(1, 3, len(TAUS))  # tau 0 best
        model.proposal.observe(grid, torch.ones(1, 3, dtype=torch.bool))
        model.proposal.keep_rows([])  # the row leaves
        summary = _proposal(make(model)).summary()
        assert summary["tau"] == 0.0 and summary["acceptance"][0.0] == pytest.approx(1.0)
    assert _proposal(SuffixDrafter()) is None and _proposal(None) is None
