"""The cost profiler and the side-by-side benchmark: shapes, contracts and reports (no timing asserts)."""

import csv
import json

import pytest

from verispec.analysis.bench import run_bench, write_reports
from verispec.analysis.profile import context_bucket, profile_costs
from verispec.cli import main
from verispec.drafters.model import ModelDrafter
from verispec.models.checkpoint import load_pretrained
from verispec.models.toy import make_toy_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, draft_dir = make_toy_pair(tmp_path_factory.mktemp("toy"))
    return target_dir, draft_dir, load_pretrained(target_dir), load_pretrained(draft_dir)


def test_profile_has_one_time_per_position_count_and_a_draft_ratio(pair):
    _, _, target, draft = pair
    profile = profile_costs(target, draft, k_max=3, context_length=20, repeats=3, use_cache=False)
    assert len(profile.target_s) == 4 and all(t > 0 for t in profile.target_s)
    assert profile.r[0] == 1.0 and profile.c > 0 and profile.context_length == 32
    assert profile_costs(target, draft, k_max=3, context_length=30, repeats=3) == profile_costs(
        target, draft, k_max=3, context_length=17, repeats=3
    )
    assert [context_bucket(n) for n in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]
    with pytest.raises(ValueError, match="k_max"):
        profile_costs(target, draft, k_max=-1)


def _counted(model) -> list:
    calls, forward = [], model.forward
    model.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    return calls


def test_candidates_drafting_with_one_file_share_its_measured_cost(pair):
    """`plan` loads a model once per candidate ('MODEL' and 'string:MODEL'): the draft's cost is
    measured once per file and the target's once per target, so that timing noise cannot rank two
    candidates drafting with one file apart. The negative control: another file is measured."""
    _, draft_dir, target, _ = pair
    one, two, other = (load_pretrained(draft_dir) for _ in range(3))
    one.path = two.path = draft_dir
    other.path = draft_dir / "elsewhere"
    first = profile_costs(target, one, k_max=2, context_length=24, repeats=2, warmup=0)
    target_calls, draft_calls = _counted(target), _counted(two)
    assert profile_costs(target, two, k_max=2, context_length=24, repeats=2, warmup=0) == first
    assert target_calls == [] and draft_calls == []
    other_calls = _counted(other)
    assert profile_costs(target, other, k_max=2, context_length=24, repeats=2, warmup=0).target_s == first.target_s
    assert target_calls == [] and len(other_calls) > 0
    del target.forward


def test_bench_reports_every_run_with_the_documented_fields(pair, tmp_path):
    _, _, target, draft = pair
    prompts = [[1, 2, 3, 4], [50, 60]]
    result = run_bench(
        target,
        lambda: ModelDrafter(draft),
        prompts,
        [1, 3, "auto"],
        [0.0, 1.0],
        max_new_tokens=6,
        repeats=2,
        draft_model=draft,
        progress=False,
    )
    runs = result["runs"]
    assert [(r["temperature"], r["k"]) for r in runs] == [
        (0.0, 1),
        (0.0, 3),
        (0.0, "auto"),
        (1.0, 1),
        (1.0, 3),
        (1.0, "auto"),
    ]
    for run in runs:
        assert run["speedup_min"] <= run["speedup"] <= run["speedup_max"]
        assert run["decode_speedup"] > 0
        assert run["tokens_per_s_baseline"] > 0 and run["tokens_per_s_speculative"] > 0
        assert run["k"] == "auto" or 1 <= run["mean_tokens_per_pass"] <= run["k"] + 1
        assert (run["greedy_identical"] is True) if run["temperature"] == 0 else run["greedy_identical"] is None
        assert (run["predicted_speedup"] is None) == (run["k"] == "auto")
    paths = write_reports(result, tmp_path / "b.json", tmp_path / "b.csv", tmp_path / "plots")
    assert json.loads((tmp_path / "b.json").read_text())["runs"][0]["k"] == 1
    assert len(list(csv.DictReader(open(tmp_path / "b.csv")))) == 6
    assert all(p.exists() and p.stat().st_size > 1000 for p in paths)


def test_decode_time_per_token_leaves_the_prefill_out():
    from verispec.analysis.bench import _decode_s_per_token
    from verispec.stats import SpecStats

    stats = SpecStats()
    stats.prefill_time_s = 0.4
    # 3 tokens at 3 tokens/s: 1 s in all, 0.6 s of it decoding
    assert _decode_s_per_token([[1, 2], [3]], 3.0, stats) == pytest.approx(0.2)


def test_bench_runs_both_sampling_modes_with_the_bound_beside_invariant_acceptance(pair, tmp_path, capsys):
    _, _, target, draft = pair
    result = run_bench(
        target,
        lambda: ModelDrafter(draft),
        [[1, 2, 3, 4], [50, 60]],
        [2],
        [0.0, 0.9],
        max_new_tokens=8,
        repeats=1,
        draft_model=draft,
        progress=False,
        samplings=("rejection", "invariant"),
    )
    runs = result["runs"]
    assert [(r["temperature"], r["sampling"]) for r in runs] == [
        (0.0, "rejection"),
        (0.9, "rejection"),
        (0.9, "invariant"),
    ]
    invariant, rejection = runs[2], runs[1]
    assert invariant["invariant_identical"] is True and rejection["invariant_identical"] is None
    assert invariant["invariant_bound"] == pytest.approx(rejection["beta"] / (2 - rejection["beta"]))
    assert set(result["best_k"]) == {"0.0", "0.9", "0.9 invariant"}
    target_dir, draft_dir, _, _ = pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n')
    assert (
        main(
            [
                "bench",
                "--target",
                str(target_dir),
                "--draft",
                str(draft_dir),
                "--prompts",
                str(prompts),
                "--sampling",
                "greedy",
            ]
        )
        == 2
    )
    assert "--sampling must list rejection and/or invariant" in capsys.readouterr().err


def test_bench_command_prints_a_table(pair, tmp_path, capsys):
    target_dir, draft_dir, _, _ = pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n{"prompt": "import os"}\n')
    code = main(
        [
            "bench",
            "--target",
            str(target_dir),
            "--draft",
            str(draft_dir),
            "--prompts",
            str(prompts),
            "--k",
            "2",
            "--max-new-tokens",
            "4",
            "--repeats",
            "1",
            "--json",
            str(tmp_path / "o.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "includes the recovered/bonus token" in out and (tmp_path / "o.json").exists()
    prompts.write_text("not json\n")
    assert main(["bench", "--target", str(target_dir), "--draft", str(draft_dir), "--prompts", str(prompts)]) == 2
    assert "p.jsonl:1" in capsys.readouterr().err


def test_position_alphas_from_known_betas():
    import torch

    from verispec.analysis.plan import position_alphas

    constant = [torch.full((50,), 0.8, dtype=torch.float64)]
    assert position_alphas(constant, 3) == pytest.approx([0.8, 0.8, 0.8])
    # alternating 1, 0: a block accepts position 1 half the time and never position 2
    alternating = [torch.tensor([1.0, 0.0] * 20, dtype=torch.float64)]
    assert position_alphas(alternating, 2) == pytest.approx([0.5, 0.0])


def test_plan_recommends_speculation_for_a_self_draft_and_not_for_a_random_one(pair, tmp_path, capsys):
    """The target as its own draft (beta = 1) pays at any c < 1 with r(n) near 1; a draft that
    disagrees everywhere (beta = 0) never pays."""
    from verispec.analysis.plan import plan
    from verispec.config import SamplingParams
    from verispec.models.llama import LlamaForCausalLM, init_weights

    _, _, target, _ = pair
    hostile = init_weights(LlamaForCausalLM(target.config.replace(num_hidden_layers=1)), std=2.0, seed=5).eval()
    report = plan(
        target,
        {"self": target, "hostile": hostile},
        [[1, 2, 3], [9, 8]],
        SamplingParams(temperature=0, max_new_tokens=12),
        k_max=4,
    )
    self_, bad = report["candidates"]
    assert self_["beta"] == pytest.approx(1.0) and self_["alpha_by_position"] == pytest.approx([1.0] * 4)
    assert self_["predicted_speedup"][0] == 1.0 and len(self_["predicted_speedup"]) == 5
    assert bad["beta"] < 0.3 and bad["recommended_k"] == 0 and bad["advice"] == "do not speculate"


def test_profile_command_compares_quantized_copies(pair, capsys):
    target_dir, _, _, _ = pair
    assert main(["profile", "--target", str(target_dir), "--compare-quantized", "--k-max", "1", "--repeats", "1"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:4]}
    assert set(rows) == {"float32", "int8", "int4-g64"} and rows["float32"][3] == "1.00"
    assert float(rows["int8"][1]) < float(rows["float32"][1]) and float(rows["int4-g64"][1]) < float(rows["int8"][1])


def test_peer_bench_against_transformers_reports_identical_greedy_tokens(pair, tmp_path, capsys):
    pytest.importorskip("transformers")
    target_dir, draft_dir, _, _ = pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n')
    # verispec's PyTorch model against transformers on the same weights (on llama.cpp, with its f16 KV cache and flash
    # attention, a near-tie may fall the other way; the report then names the logit gap: the test after this one)
    assert (
        main(
            [
                "bench",
                "--peer",
                "hf",
                "--target",
                str(target_dir),
                "--draft",
                str(draft_dir),
                "--prompts",
                str(prompts),
                "--k",
                "3",
                "--max-new-tokens",
                "6",
                "--repeats",
                "1",
                "--backend",
                "torch",
                "--json",
                str(tmp_path / "peer.json"),
            ]
        )
        == 0
    )
    runs = {r["system"]: r for r in json.loads((tmp_path / "peer.json").read_text())["runs"]}
    assert set(runs) == {"verispec plain", "transformers plain", "verispec k=3", "transformers assisted k=3"}
    assert all(r["identical_to_transformers_plain"] for r in runs.values())
    assert runs["transformers assisted k=3"]["vs_transformers_assisted"] == 1.0
    assert (
        main(
            [
                "bench",
                "--peer",
                "hf",
                "--target",
                str(target_dir),
                "--draft",
                "ngram",
                "--prompts",
                str(prompts),
                "--k",
                "2",
                "--max-new-tokens",
                "6",
                "--repeats",
                "1",
            ]
        )
        == 0
    )
    assert "transformers prompt lookup k=2" in capsys.readouterr().out


def test_peer_bench_against_llama_cpp_reports_identical_greedy_tokens(pair, tmp_path, capsys):
    """verispec on llama.cpp against llama-cpp-python on the same GGUF files (llama.cpp's own
    speculative program is not built in CI: it needs --llama-cpp-bin, and is refused without it)."""
    target_dir, draft_dir, _, _ = pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n{"prompt": "ab ab ab"}\n')
    common = [
        "bench",
        "--peer",
        "llamacpp",
        "--target",
        str(target_dir),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "8",
        "--repeats",
        "1",
    ]
    assert main(common + ["--draft", str(draft_dir), "--k", "2,auto", "--json", str(tmp_path / "peer.json")]) == 0
    report = json.loads((tmp_path / "peer.json").read_text())
    runs = {r["system"]: r for r in report["runs"]}
    assert set(runs) == {"llama.cpp plain (llama-cpp-python)", "verispec plain", "verispec k=2", "verispec k=auto"}
    # exact: verispec's speculative rows are its plain rows; whether those are llama-cpp-python's own (flash attention
    # off, one-token kernels) is reported, the same for every verispec row (docs/EXACTNESS.md)
    assert all(runs[s]["identical_to_verispec_plain"] for s in ("verispec plain", "verispec k=2", "verispec k=auto"))
    assert len({runs[s]["identical_prompts"] for s in ("verispec plain", "verispec k=2", "verispec k=auto")}) == 1
    assert runs["verispec k=2"]["alpha_hat"] is not None and runs["verispec k=2"]["own_ms_per_pass"] > 0
    assert (
        main(
            common
            + [
                "--draft",
                str(draft_dir),
                "--k",
                "2",
                "--confidence-threshold",
                "0.5",
                "--json",
                str(tmp_path / "confident.json"),
            ]
        )
        == 0
    )
    runs = {r["system"]: r for r in json.loads((tmp_path / "confident.json").read_text())["runs"]}
    assert {"verispec k=2", "verispec k=2, confidence 0.5"} <= set(runs)  # each draft length with and without the stop
    long = tmp_path / "long.jsonl"  # longer than llama-cpp-python's batch of 512: its lookup keeps every row's logits
    long.write_text(json.dumps({"prompt": "ab " * 400}) + "\n")
    assert main(common + ["--draft", "ngram", "--k", "2", "--prompts", str(long)]) == 0
    assert "llama.cpp prompt lookup k=2 (llama-cpp-python)" in capsys.readouterr().out
    assert main(common + ["--draft", str(draft_dir), "--llama-cpp-bin", str(tmp_path)]) == 2
    assert "llama-speculative-simple" in capsys.readouterr().err
    assert main(common + ["--draft", "ngram", "--peer-ngram", "all"]) == 2  # the n-gram drafters are the program's
    assert "--peer-ngram needs --peer llamacpp and --llama-cpp-bin" in capsys.readouterr().err
    for flags, message in ((["--peer-ngram", "ngram-x"], "--peer-ngram must be"), (["--peer-ngram-lengths", "0"], "")):
        assert main(common + ["--draft", "ngram", "--llama-cpp-bin", str(tmp_path), "--peer-ngram", "all", *flags]) == 2
        assert (message or "--peer-ngram-lengths must list") in capsys.readouterr().err
    assert main(common + ["--draft", "ngram", "--k", "2", "--peer-suffix", "--json", str(tmp_path / "s.json")]) == 0
    runs = {r["system"]: r for r in json.loads((tmp_path / "s.json").read_text())["runs"]}
    assert runs["verispec suffix k=2"]["identical_to_verispec_plain"]
    assert main(common + ["--draft", "suffix", "--k", "2", "--json", str(tmp_path / "a.json")]) == 0  # auto's choice
    assert "verispec suffix k=2" in {r["system"] for r in json.loads((tmp_path / "a.json").read_text())["runs"]}
    combined = ["--draft", str(draft_dir), "--k", "2", "--peer-suffix", "--json", str(tmp_path / "c.json")]
    assert main(common + combined) == 0
    runs = {r["system"]: r for r in json.loads((tmp_path / "c.json").read_text())["runs"]}
    assert runs["verispec suffix+draft k=2"]["identical_to_verispec_plain"]


def test_a_difference_is_explained_by_the_targets_top2_logit_gap(pair):
    transformers = pytest.importorskip("transformers")
    import torch

    from verispec.analysis.peer_hf import explain_difference

    target_dir, _, _, _ = pair
    hf_target = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    prompt, reference = [5, 6, 7], [9, 10, 11]
    with torch.no_grad():
        logits = hf_target(torch.tensor([prompt + reference[:1]])).logits[0, -1]
    top = logits.topk(2)
    other = [9, int(top.indices[1]), 3]
    assert explain_difference(hf_target, prompt, reference, list(reference)) is None
    report = explain_difference(hf_target, prompt, reference, other)
    assert report["position"] == 1 and report["tokens"] == [10, other[1]] and report["second_choice"]
    assert report["top2_gap"] == pytest.approx(float(top.values[0] - top.values[1]))


def test_plan_scores_prompt_lookup_by_its_proposal_after_each_true_prefix():
    from verispec.analysis.plan import _lookup
    from verispec.drafters.ngram import PromptLookupDrafter

    proposals, found = _lookup(PromptLookupDrafter(), [5, 6, 7, 5, 6, 7, 5], 4, 2)  # prefixes ..5 / ..5 6 / ..5 6 7
    assert proposals.tolist() == [[6, 7], [7, 5], [5, 6]] and found.tolist() == [True, True, True]
    _, found = _lookup(PromptLookupDrafter(), [5, 6, 7, 8, 6, 1], 1, 1)  # ..5 (none) ..5 6 ..7 ..8 (none) ..8 6
    assert found.tolist() == [False, False, False, False, True]


def test_position_alphas_count_only_the_blocks_that_start_where_the_drafter_proposes():
    import torch

    from verispec.analysis.plan import position_alphas

    betas = [torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)]
    starts = [torch.tensor([False, True, False, True, True, True])]
    # alpha_1 over starts 1, 3, 4, 5 (beta 1 each); blocks of two from 1, 3, 4: products 0, 1, 1
    assert position_alphas(betas, 2, starts) == pytest.approx([1.0, 2 / 3])
    assert position_alphas(betas, 1) == pytest.approx([4 / 6])


def test_replay_cost_by_hand():
    import torch

    from verispec.analysis.plan import replay_cost

    # T = 3, k = 1: from 0 the proposal is accepted with probability 0.5 (on to 2, else to 1);
    # no proposal at 1 (a plain pass); from 2, accepted or not, the end. Costs: r(2) = 1.5.
    beta, proposes = torch.tensor([[0.5], [1.0], [1.0]], dtype=torch.float64), torch.tensor([True, False, True])
    cost_2, cost_1 = 1.5, 1.0 + 1.5
    assert replay_cost(beta, proposes, 1, 0.0, [1.0, 1.5]) == pytest.approx(1.5 + 0.5 * cost_2 + 0.5 * cost_1)
    assert replay_cost(beta, proposes, 0, 0.0, [1.0, 1.5]) == 3.0
    # k = 3 but the drafter proposes 1 token from 0 and 2 from 2 (suffix drafting's short matches): a pass
    # costs r(proposed + 1), not r(k + 1). From 0: accepted (0.5) -> 2, else -> 1 (a plain pass, then 2).
    beta = torch.tensor([[0.5, 0, 0], [1.0, 0, 0], [1.0, 1.0, 0]], dtype=torch.float64)
    lengths, r = torch.tensor([1, 0, 2]), [1.0, 1.5, 2.0, 4.0]
    from_2 = 2.0  # one pass of 2 proposals reaches the end
    expected = 1.5 + 0.5 * from_2 + 0.5 * (1.0 + from_2)
    assert replay_cost(beta, proposes, 3, 0.0, r, lengths=lengths) == pytest.approx(expected)
    assert replay_cost(beta, proposes, 3, 0.0, r) == pytest.approx(4.0 + 0.5 * 4.0 + 0.5 * (1.0 + 4.0))  # r(k + 1)


@pytest.mark.parametrize("k", [1, 3])
def test_plan_replay_counts_the_engines_passes_under_greedy(pair, k):
    """Greedy: beta is 0 or 1, so the replay's cost with c = 0 and r = 1 is the number of
    target passes the engine makes on the same continuation, for a draft model and for
    prompt lookup (whose blocks start after rejections, not at every position) and suffix
    drafting (whose proposals may be shorter than k); a combined draft's forward walk (its gate) likewise."""
    from verispec.analysis.plan import combined_cost, combined_rows, replay_cost, teacher_forced_blocks
    from verispec.config import SamplingParams
    from verispec.drafters.combined import CombinedDrafter
    from verispec.drafters.ngram import PromptLookupDrafter
    from verispec.drafters.suffix import SuffixDrafter
    from verispec.engine import generate_all
    from verispec.stats import SpecStats

    _, _, target, draft = pair
    params = SamplingParams(temperature=0, max_new_tokens=40)
    prompts = [[1, 2, 3, 1, 2], [9, 8, 7], [4, 4, 4, 4]]
    sequences = [p + c for p, c in zip(prompts, generate_all(target, prompts, params))]
    combined = lambda: CombinedDrafter(SuffixDrafter(), ModelDrafter(draft))  # noqa: E731
    for candidate in (draft, PromptLookupDrafter(), SuffixDrafter(), combined()):
        blocks = teacher_forced_blocks(target, candidate, sequences, [len(p) for p in prompts], params, k)
        passes = []
        for prompt in prompts:
            stats = SpecStats()
            drafter = (
                combined()
                if isinstance(candidate, CombinedDrafter)
                else candidate
                if isinstance(candidate, (PromptLookupDrafter, SuffixDrafter))
                else ModelDrafter(candidate)
            )
            generate_all(target, [prompt], params, drafter, k=k, stats=stats)
            passes.append(stats.target_passes)
        if isinstance(candidate, CombinedDrafter):
            rows = combined_rows(target, candidate, sequences, [len(p) for p in prompts], params, k)
            costs = [combined_cost(row, k, 0.0, [1.0] * (k + 1)) for row in rows]
        else:
            costs = [replay_cost(beta, flags, k, 0.0, [1.0] * (k + 1)) for beta, flags in blocks]
        assert costs == pytest.approx(passes)
        assert min(passes) < 40  # something was accepted


def test_plan_and_bench_commands_take_every_kind_of_draft(pair, tmp_path, capsys):
    target_dir, draft_dir, _, _ = pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x): return f(x)"}\n')
    common = ["--target", str(target_dir), "--prompts", str(prompts), "--max-new-tokens", "6"]
    assert (
        main(
            [
                "plan",
                *common,
                "--k-max",
                "2",
                "--draft",
                str(draft_dir),
                "--draft",
                "ngram",
                "--draft",
                "suffix",
                "--draft",
                "early-exit:1",
                "--draft",
                f"suffix+{draft_dir}",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("draft ")] == [
        f"draft {draft_dir}",
        "draft ngram",
        "draft suffix",
        "draft early-exit",
        f"draft suffix+{draft_dir}",
    ]
    assert out.splitlines()[-1].startswith("best: ")
    assert (
        main(
            [
                "bench",
                *common,
                "--draft",
                "early-exit:1",
                "--k",
                "2",
                "--repeats",
                "1",
                "--json",
                str(tmp_path / "e.json"),
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "e.json").read_text())
    assert 0 < result["draft_bytes_per_token"] < result["target_bytes_per_pass"] and result["best_k"]["0.0"]["k"] == 2
    assert result["runs"][0]["greedy_identical"] is True
    assert main(["bench", *common, "--draft", "early-exit:x"]) == 2
    assert "early-exit:L needs a layer count" in capsys.readouterr().err


def test_the_profile_stays_within_the_models_context(pair):
    """The context bucket rounds up (2040 -> 2048); the profile must still fit k_max + 1 more
    positions in the model's 2048."""
    _, _, target, _ = pair
    limit = target.config.max_position_embeddings
    profile = profile_costs(target, None, k_max=3, context_length=limit - 8, repeats=1, warmup=0, use_cache=False)
    assert profile.context_length + 3 + 1 <= limit < context_bucket(limit - 8) + 3 + 1


def test_llama_cpp_program_command_lines_for_the_draft_model_and_each_ngram_drafter(tmp_path):
    from verispec.analysis import llamacpp_program as lp
    from verispec.config import SamplingParams

    program, target, draft = tmp_path / "llama-speculative-simple", tmp_path / "t.gguf", tmp_path / "d.gguf"
    greedy, sampled = SamplingParams(temperature=0.0, seed=0), SamplingParams(temperature=1.0, seed=7)
    line = lp.command(program, target, "def f():", 16, greedy, 2, 256, draft=draft, k=3, p_min=0.5)
    assert line[line.index("--spec-type") + 1] == "draft-simple" and line[line.index("-md") + 1] == str(draft)
    assert line[line.index("-p") + 1] == "def f():" and line.index("--no-escape") < line.index("-p")
    assert line[line.index("--spec-draft-n-max") + 1] == "3" and line[line.index("--spec-draft-p-min") + 1] == "0.5"
    for spec_type, flag in lp.NGRAM_LENGTH_FLAGS.items():
        line = lp.command(program, target, "def f():", 16, sampled, 2, 256, ngram=spec_type, k=16)
        assert line[line.index("--spec-type") + 1] == spec_type and "-md" not in line and "-td" not in line
        assert (line[line.index(flag) + 1] == "16") if flag else not any(a.startswith("--spec-ngram") for a in line)
        assert line[line.index("--temp") + 1] == "1.0" and line[line.index("-s") + 1] == "7"
    # chained: the n-gram drafter first at its own length, the draft model where it finds nothing
    line = lp.command(program, target, "x", 16, sampled, 2, 256, draft=draft, ngram="ngram-mod", ngram_length=48, k=4)
    assert line[line.index("--spec-type") + 1] == "ngram-mod,draft-simple" and line.count("--spec-type") == 1
    assert line[line.index("--spec-ngram-mod-n-max") + 1] == "48" and line[line.index("--spec-draft-n-max") + 1] == "4"
    assert line[line.index("-fa") + 1] == "off"
    from verispec.llamacpp.lib import extra_buffers_fault

    assert ("--no-repack" in line) == extra_buffers_fault()  # where AMX buffers fault, as llama-cpp-python runs
    line = lp.command(program, target, "x", 16, greedy, 2, 256, draft=draft, flash=True)
    assert line[line.index("-fa") + 1] == "on"
    with pytest.raises(ValueError, match="an n-gram drafter or both"):
        lp.command(program, target, "x", 16, greedy, 2, 256)
    assert lp.ngram_lengths("ngram-cache", [4, 16]) == [lp.NGRAM_CACHE_LENGTH]
    assert lp.ngram_lengths("ngram-mod", [4, 16]) == [4, 16]


def test_llama_cpp_program_names_and_lengths_are_parsed_with_one_line_errors():
    from verispec.analysis.llamacpp_program import NGRAM_LENGTH_FLAGS, parse_lengths, parse_ngram_types

    assert parse_ngram_types("all") == list(NGRAM_LENGTH_FLAGS)
    assert parse_ngram_types("ngram-mod, ngram-simple,ngram-mod") == ["ngram-mod", "ngram-simple"]
    for bad in ("", "ngram-modd", "all,ngram-mod", "draft-simple"):
        with pytest.raises(ValueError, match="--peer-ngram must be"):
            parse_ngram_types(bad)
    assert parse_lengths("4,16,4") == [4, 16]
    for bad in ("", "0", "4,x", "-2"):
        with pytest.raises(ValueError, match="--peer-ngram-lengths"):
            parse_lengths(bad)


def test_llama_cpp_program_output_is_parsed_into_text_speed_and_acceptance():
    from verispec.analysis.llamacpp_program import parse_output

    log = (
        "main: encoded   12 tokens in    0.010 seconds, speed: 1200.000 t/s\n"
        "main: decoded  130 tokens in    0.650 seconds, speed:  200.000 t/s\n\n"
        "n_draft   = 3\nn_predict = 130\nn_drafted = 96\nn_accept  = 72\naccept    = 75.000%\n"
    )
    parsed = parse_output("\n\ndef f():\n    return 1\n\n", log, "def f():")
    assert parsed == {"text": "\n    return 1", "decoded": 130, "seconds": 0.65, "drafted": 96, "accepted": 72}
    assert parse_output("\n\ndef f():", "main: error\n", "def f():") is None


def test_each_ngram_drafter_is_reported_at_its_fastest_draft_length():
    from verispec.analysis.llamacpp_program import keep_best_lengths, ngram_system

    sweeps = {ngram_system("ngram-mod", k): ("ngram-mod", k) for k in (4, 16, 48)}
    sweeps[ngram_system("ngram-cache", 8)] = ("ngram-cache", 8)
    speeds = {4: 90.0, 16: 120.0, 48: 120.0}
    rows = [{"system": "verispec plain", "tokens_per_s": 100.0}]
    rows += [
        {"system": ngram_system("ngram-mod", k), "tokens_per_s": s, "alpha_hat": k / 100} for k, s in speeds.items()
    ]
    rows += [{"system": ngram_system("ngram-cache", 8), "tokens_per_s": 80.0}]
    kept = keep_best_lengths(rows, sweeps)
    assert [r["system"] for r in kept] == [
        "verispec plain",
        "llama.cpp ngram-mod n=16, best of 4,16,48",  # a tie goes to the shorter draft
        "llama.cpp ngram-cache n=8, fixed",
    ]
    assert kept[1]["alpha_hat"] == 0.16 and kept[1]["draft_length"] == 16
    assert kept[1]["draft_length_sweep"] == {"4": 90.0, "16": 120.0, "48": 120.0}
    assert kept[0] is rows[0] and keep_best_lengths(rows[:1], {}) == rows[:1]


def _llama_cpp_bin():
    """The directory of a built llama-speculative-simple: $VERISPEC_LLAMA_CPP_BIN, else the build
    script's default output; None when neither holds the program."""
    import os
    from pathlib import Path

    for directory in (os.environ.get("VERISPEC_LLAMA_CPP_BIN"), "runs/llama-bin/build/bin"):
        if directory and (Path(directory) / "llama-speculative-simple").is_file():
            return directory
    return None


@pytest.mark.skipif(_llama_cpp_bin() is None, reason="no llama-speculative-simple built here")
def test_llama_cpp_ngram_drafters_run_and_match_plain_greedy_text(tmp_path, capsys):
    """llama.cpp's own n-gram drafters, through the real program (benchmarks/build_llama_speculative.sh), on the
    built-in target (the program prints text, so the toy models' unprintable bytes would not compare)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n    return x + '\\n'\n\n\ndef f(x):"}) + "\n")  # a backslash
    flags = ["--prompts", str(prompts), "--max-new-tokens", "16", "--repeats", "1"]
    assert (
        main(
            ["bench", "--peer", "llamacpp", *flags, "--draft", "ngram", "--k", "2", "--llama-cpp-bin", _llama_cpp_bin()]
            + [
                "--peer-ngram",
                "ngram-mod,ngram-cache",
                "--peer-ngram-lengths",
                "2,4",
                "--json",
                str(tmp_path / "n.json"),
            ]
        )
        == 0
    )
    runs = {r["system"]: r for r in json.loads((tmp_path / "n.json").read_text())["runs"]}
    mod = next(r for s, r in runs.items() if s.startswith("llama.cpp ngram-mod n="))
    assert mod["system"].endswith("best of 2,4") and set(mod["draft_length_sweep"]) == {"2", "4"}
    assert "llama.cpp ngram-cache n=8, fixed" in runs
    assert all(r["identical_to_llamacpp_plain"] for r in runs.values())
    assert max(r["vs_llamacpp_ngram_best"] for r in runs.values() if "draft_length_sweep" in r) == 1.0
    assert "vs n-gram best" in capsys.readouterr().out


def test_a_combined_drafts_forward_walk_is_the_replay_where_its_lookup_never_proposes():
    """At T > 0 `combined_cost` averages seeded walks of the passes: where the lookup never proposes, every pass is the
    model's and the mean of many walks must match `replay_cost`'s exact expectation (1.5% is over 7 standard errors
    here); where the lookup proposes everywhere and is always right, it drafts alone: no draft cost, r(k + 1) a pass."""
    import torch

    from verispec.analysis.plan import CombinedRow, combined_cost, replay_cost

    generator = torch.Generator().manual_seed(0)
    length, k, c, r = 60, 3, 0.2, [1.0, 1.1, 1.2, 1.3]
    model = torch.rand(length, k, generator=generator, dtype=torch.float64) * 0.8 + 0.1  # [T, k] in (0.1, 0.9)
    never = CombinedRow(torch.zeros_like(model), model, torch.zeros(length, dtype=torch.bool), torch.zeros(length))
    expected = replay_cost(model, torch.ones(length, dtype=torch.bool), k, c, r)
    assert combined_cost(never, k, c, r, draws=4000) == pytest.approx(expected, rel=0.015)
    always = CombinedRow(torch.ones_like(model), model, torch.ones(length, dtype=torch.bool), torch.full((length,), k))
    assert combined_cost(always, k, c, r) == pytest.approx(r[k] * length / (k + 1))  # k + 1 tokens a pass
