"""The command line: it streams text and one statistics line; batches, standard input, stop
strings and JSON output. Bad input: tests/test_cli_errors.py."""

import subprocess
import sys

import pytest

from verispec.cli import main, parse_args
from verispec.models.toy import make_toy_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_toy_pair(tmp_path_factory.mktemp("toy"))


def test_generate_streams_text_and_a_statistics_line(pair, capsys):
    target, draft = pair
    code = main(
        [
            "generate",
            "def f(x):",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--k",
            "3",
            "--max-new-tokens",
            "12",
            "--temperature",
            "0.8",
            "--seed",
            "1",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0].startswith("def f(x):")
    assert out[-1].startswith("12 tokens in") and "alpha_hat" in out[-1] and "mean tokens/target pass" in out[-1]


def test_no_speculation_matches_speculative_greedy_text(pair, capsys):
    target, draft = pair
    common = ["generate", "--prompt", "import os", "--target", str(target), "--max-new-tokens", "16", "--ignore-eos"]
    assert main(common + ["--draft", str(draft), "--no-speculation"]) == 0
    plain = capsys.readouterr().out.splitlines()
    assert main(common + ["--draft", str(draft), "--k", "4"]) == 0
    spec = capsys.readouterr().out.splitlines()
    # no draft; on a target that pads one-position passes the placeholder checks a guess (drafters/placeholder.py)
    assert ("no speculation" in plain[-1] or "no draft" in plain[-1]) and "alpha_hat" in spec[-1]
    assert plain[:-1] == spec[:-1]


def test_a_seed_in_invariant_mode_gives_the_text_of_plain_sampling(pair, capsys):
    target, draft = pair
    common = [
        "generate",
        "--prompt",
        "import os",
        "--target",
        str(target),
        "--max-new-tokens",
        "16",
        "--ignore-eos",
        "--temperature",
        "0.9",
        "--seed",
        "7",
        "--sampling",
        "invariant",
        "--draft",
        str(draft),
    ]
    texts = []
    for extra in (["--no-speculation"], ["--k", "4"], ["--k", "auto"], ["--k", "1"]):
        assert main(common + extra) == 0
        texts.append(capsys.readouterr().out.splitlines()[:-1])
    assert all(text == texts[0] for text in texts)


def test_a_prompts_line_sets_its_own_rows_seed_temperature_and_budget(pair, tmp_path, capsys):
    import json

    target, draft = pair
    lines = [
        {"prompt": "import os", "seed": 3, "temperature": 0.9},
        {"prompt": "def f(x):", "temperature": 0, "max_new_tokens": 5},
        {"prompt": "import os", "seed": 3, "temperature": 0.9},
        {"prompt": "import os", "seed": 4, "temperature": 0.9},
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.json"
    common = [
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--k",
        "3",
        "--max-new-tokens",
        "16",
        "--ignore-eos",
        "--temperature",
        "0.5",
    ]
    assert main(["generate", "--prompts", str(tmp_path / "rows.jsonl"), "--json", str(out), *common]) == 0
    rows = [r["token_ids"] for r in json.loads(out.read_text())["results"]]
    assert rows[0] == rows[2] != rows[3] and [len(r) for r in rows] == [16, 5, 16, 16]
    assert (
        main(["generate", "def f(x):", "--json", str(out), *common, "--temperature", "0", "--max-new-tokens", "5"]) == 0
    )
    assert (
        json.loads(out.read_text())["results"][0]["token_ids"] == rows[1]
    )  # the greedy row: greedy, whatever the flags said


def test_prompt_lookup_drafter_from_the_command_line(pair, capsys):
    target, _ = pair
    assert (
        main(
            [
                "generate",
                "ab ab ab ab",
                "--target",
                str(target),
                "--draft",
                "ngram",
                "--max-new-tokens",
                "10",
                "--ignore-eos",
            ]
        )
        == 0
    )
    assert "alpha_hat" in capsys.readouterr().out.splitlines()[-1]


def test_early_exit_drafter_from_the_command_line(pair, capsys):
    target, _ = pair
    common = [
        "generate",
        "def f(x):",
        "--target",
        str(target),
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--k",
        "2",
    ]  # auto may not draft
    assert main(common + ["--draft", "early-exit:2"]) == 0  # an early-exit draft runs its target on torch
    spec = capsys.readouterr().out.splitlines()
    assert main(common + ["--backend", "torch"]) == 0
    assert capsys.readouterr().out.splitlines()[:-1] == spec[:-1] and "alpha_hat" in spec[-1]
    assert main(common + ["--draft", "early-exit:x"]) == 2
    assert "early-exit:L" in capsys.readouterr().err


def test_k_auto_runs_and_reports(pair, capsys):
    target, draft = pair
    assert (
        main(
            [
                "generate",
                "x = 1",
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--k",
                "auto",
                "--max-new-tokens",
                "20",
                "--ignore-eos",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.splitlines()[-1].startswith("20 tokens in")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_confidence_stop_is_off_unless_given_with_k_auto_too(command):
    prompt = ["x"] if command == "generate" else []
    assert parse_args([command, *prompt]).k == "auto"  # the default
    assert (
        parse_args([command, *prompt]).confidence_threshold == 0.0
    )  # auto with a stop at 0.3 served 0.96-0.98 of auto without it
    assert parse_args([command, *prompt, "--k", "3"]).confidence_threshold == 0.0
    assert parse_args([command, *prompt, "--confidence-threshold", "0.3"]).confidence_threshold == 0.3
    assert parse_args([command, *prompt, "--k", "3", "--confidence-threshold", "0.5"]).confidence_threshold == 0.5
    assert parse_args(["bench", "--prompts", "p.jsonl"]).confidence_threshold == 0.0


def test_console_script_runs_in_a_subprocess(pair):
    result = subprocess.run(
        [sys.executable, "-m", "verispec.cli", "generate", "x", "--target", str(pair[0]), "--max-new-tokens", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "3 tokens in" in result.stdout


def test_generate_a_prompts_file_as_one_batch_equals_separate_runs(tmp_path, capsys):
    """The built-in pair on the default backend, greedy: 8 prompts in one batch (--prompts,
    --json) give each prompt the tokens of its own run."""
    import json

    texts = [json.loads(line)["prompt"] for line in open("benchmarks/heldout.jsonl").read().splitlines()[:8]]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    common = ["--max-new-tokens", "24", "--k", "3"]
    assert (
        main(["generate", "--prompts", str(tmp_path / "prompts.jsonl"), "--json", str(tmp_path / "out.json"), *common])
        == 0
    )
    batched = json.loads((tmp_path / "out.json").read_text())
    assert [r["prompt"] for r in batched["results"]] == texts and batched["stats"]["generated_tokens"] == sum(
        len(r["token_ids"]) for r in batched["results"]
    )
    for text, result in zip(texts, batched["results"]):
        assert main(["generate", "--prompt", text, "--json", str(tmp_path / "one.json"), *common]) == 0
        alone = json.loads((tmp_path / "one.json").read_text())["results"][0]
        assert alone["token_ids"] == result["token_ids"] and alone["text"] == result["text"]
    capsys.readouterr()


def test_stdin_stop_strings_and_json(pair, tmp_path, monkeypatch, capsys):
    import io
    import json

    target, draft = pair
    common = [
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--k",
        "2",
        "--max-new-tokens",
        "40",
        "--ignore-eos",
        "--backend",
        "torch",
    ]
    assert main(["generate", "--prompt", "def f(x):", "--json", str(tmp_path / "full.json"), *common]) == 0
    full = json.loads((tmp_path / "full.json").read_text())["results"][0]["text"]
    stop = full[5:7]  # a piece of the continuation: it must end before its first occurrence
    monkeypatch.setattr(sys, "stdin", type("Stdin", (), {"buffer": io.BytesIO(b"def f(x):")})())
    assert main(["generate", "-", "--stop", stop, "--json", str(tmp_path / "cut.json"), *common]) == 0
    cut = json.loads((tmp_path / "cut.json").read_text())["results"][0]
    assert cut["text"] == full[: full.index(stop)] and cut["finish_reason"] == "stop" and cut["prompt"] == "def f(x):"
    capsys.readouterr()


def test_stop_values_read_the_usual_escapes_and_keep_other_text():
    from verispec.cli.generate import unescape

    assert unescape(r"\n\n") == "\n\n" and unescape(r"\t|\r") == "\t|\r" and unescape(r"\\n") == "\\n"
    assert unescape(r"\"q\'") == "\"q'" and unescape(r"caf\u00e9") == "café" and unescape("café\\n") == "café\n"
    assert unescape(r"\ud83d\ude00") == "😀" and unescape(r"\d") == r"\d" and unescape("a\\") == "a\\"


def _continuations(target, texts: list[str], common: list[str], tmp_path) -> dict:
    import json

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    assert (
        main(["generate", "--prompts", str(tmp_path / "in.jsonl"), "--json", str(tmp_path / "out.json"), *common]) == 0
    )
    return json.loads((tmp_path / "out.json").read_text())


def test_a_row_that_reaches_its_stop_string_stops_decoding_and_its_token_ids_end_there(pair, tmp_path, capsys):
    """Two rows, greedy: a stop string (written with \\u escapes) found in row 0's text only. Row
    0 keeps the fewest tokens whose text holds it and stops decoding; row 1 runs to its budget."""
    from verispec.models.checkpoint import load_tokenizer

    target, draft = pair
    common = [
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--k",
        "2",
        "--max-new-tokens",
        "40",
        "--ignore-eos",
        "--backend",
        "torch",
    ]
    texts = ["def f(x):", "import os"]
    full = _continuations(target, texts, common, tmp_path)
    first, second = (r["text"] for r in full["results"])
    stop = next(
        first[i : i + 2]
        for i in range(3, len(first) - 1)
        if first[i : i + 2] not in second and "\\" not in first[i : i + 2]
    )
    escaped = "".join(f"\\u{ord(c):04x}" for c in stop)
    cut = _continuations(target, texts, [*common, "--stop", escaped], tmp_path)
    row, other = cut["results"]
    decode = load_tokenizer(target).decode
    assert row["text"] == first[: first.index(stop)] and row["finish_reason"] == "stop"
    assert stop in decode(row["token_ids"]) and stop not in decode(row["token_ids"][:-1])
    assert other == full["results"][1] and len(other["token_ids"]) == 40
    assert cut["stats"]["generated_tokens"] == sum(len(r["token_ids"]) for r in cut["results"])
    assert cut["stats"]["target_passes"] < full["stats"]["target_passes"]  # row 0 took no passes past its stop
    capsys.readouterr()


def test_json_with_one_prompt_streams_the_text_as_without_it(pair, tmp_path, capsys):
    """--json OUT adds a file; standard output is the same (a multi-character stop string that
    arrives over several passes is never half shown)."""
    import json

    target, draft = pair
    common = [
        "generate",
        "def f(x):",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--k",
        "2",
        "--max-new-tokens",
        "30",
        "--ignore-eos",
        "--backend",
        "torch",
    ]
    assert main([*common, "--json", str(tmp_path / "full.json")]) == 0
    full = json.loads((tmp_path / "full.json").read_text())["results"][0]["text"]
    assert capsys.readouterr().out.startswith("def f(x):" + full + "\n")
    stop = full[6:10]
    assert main([*common, "--stop", stop.replace("\\", "\\\\"), "--json", str(tmp_path / "cut.json")]) == 0
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "cut.json").read_text())["results"][0]["text"] == full[: full.index(stop)]
    assert out.startswith("def f(x):" + full[: full.index(stop)] + "\n")
    assert main([*common, "--stop", stop.replace("\\", "\\\\")]) == 0
    assert (
        capsys.readouterr().out.splitlines()[:-1] == out.splitlines()[:-2]
    )  # without --json: the same, less "wrote OUT"


@pytest.mark.parametrize("target", ["toy", "built-in"])
def test_draft_none_means_no_draft_as_in_serve(pair, capsys, target):
    where = ["--target", str(pair[0])] if target == "toy" else []
    assert (
        main(
            [
                "generate",
                "def f(x):",
                *where,
                "--draft",
                "none",
                "--max-new-tokens",
                "4",
                "--ignore-eos",
                "--backend",
                "torch",
            ]
        )
        == 0
    )
    assert "no speculation, 4 target passes" in capsys.readouterr().out.splitlines()[-1]


@pytest.mark.parametrize(
    "argv",
    [
        ["--no-speculation", "--k", "0"],
        ["--k", "4", "--k-max", "8"],
        ["--k", "12"],
        ["--gguf-type", "q8_0"],
        ["--target", "m.gguf", "--draft", "hf/draft", "--gguf-type", "q8_0"],
    ],
)
def test_flags_that_fit_together_parse(argv):
    """The contradictions refused (tests/test_cli_errors.py) are only those: --k 0 is plain decoding, a
    fixed k needs no --k-max, and --gguf-type converts a directory given beside a GGUF target."""
    args = parse_args(["generate", "hi", *argv])
    assert args.k_max == int(argv[argv.index("--k-max") + 1]) if "--k-max" in argv else args.k_max == 8


def test_a_flag_means_one_thing_in_every_command():
    """--seed is the sampling seed wherever it appears (train's and toy's seeds of weights have
    names of their own), --top-k the sampling filter (train teacher's is --teacher-top-k), and
    bench-serve's budget per request is --max-new-tokens as elsewhere (--max-tokens still parses)."""
    for argv in (["generate", "x"], ["plan", "--prompts", "p"], ["check"]):
        assert parse_args([*argv, "--seed", str(2**63 - 1)]).seed == 2**63 - 1
    bench = ["bench", "--prompts", "p"]  # bench's --k, --temperature and --seed are lists of what it compares
    assert parse_args([*bench, "--seed", f"{2**63 - 1},0"]).seed == [2**63 - 1, 0]
    assert [parse_args([*argv, "--top-k", "8"]).top_k for argv in (["generate", "x"], bench, ["check"])] == [8] * 3
    assert parse_args(["train", "target", "--train-seed", "3"]).train_seed == 3
    assert parse_args(["toy", "out", "--weights-seed", "3"]).weights_seed == 3
    assert parse_args(["train", "teacher", "--teacher-top-k", "8"]).teacher_top_k == 8
    for argv in (
        ["train", "target", "--seed", "3"],
        ["toy", "out", "--seed", "3"],
        ["train", "teacher", "--top-k", "8"],
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
    assert parse_args(["bench-serve", "--max-new-tokens", "6"]).max_new_tokens == 6
    assert parse_args(["bench-serve", "--max-tokens", "6"]).max_new_tokens == 6
    assert all(
        parse_args(argv + ["--draft", "none"]).draft == "none" for argv in (["generate", "x"], ["serve"], ["profile"])
    )


def test_generate_help_says_what_target_draft_and_stop_take(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0
    assert "--target TARGET target model: a directory of Hugging Face-style weights or a .gguf file" in text
    assert "or 'none' (no speculation)" in text and "\\n \\t \\r" in text and "(one prompt streams its text)" in text


def test_threads_above_the_cores_are_capped_with_one_line(pair, capsys):
    from verispec.llamacpp import default_threads, unavailable

    if unavailable() is not None:
        pytest.skip("llama.cpp does not run here")
    target, draft = pair
    code = main(
        [
            "generate",
            "def f(x):",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--backend",
            "llamacpp",
            "--max-new-tokens",
            "4",
            "--threads",
            "1000",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0
    assert (
        err.count(
            f"--threads 1000 is more than the {default_threads()} cores this process may use; using {default_threads()}"
        )
        == 1
    )


def test_exact_kernels_off_in_a_process_that_runs_them_on_is_one_line(pair, capsys):
    from verispec.llamacpp import LlamaCppModel, unavailable
    from verispec.llamacpp.lib import library

    if unavailable() is not None:
        pytest.skip("llama.cpp does not run here")
    library()  # this process's llama.cpp is initialised with exact kernels (the default)
    target, draft = pair
    code = main(
        [
            "generate",
            "hi",
            "--target",
            str(target),
            "--backend",
            "llamacpp",
            "--exact-kernels",
            "off",
            "--max-new-tokens",
            "2",
        ]
    )
    assert (
        code == 2
        and "--exact-kernels off: this process already runs llama.cpp with the other setting" in capsys.readouterr().err
    )
    assert LlamaCppModel.__init__  # nothing else changed: the setting stays on
    from verispec.llamacpp import exact_kernels

    assert exact_kernels()


def test_exact_kernels_off_runs_llama_cpps_default_kernels_in_a_fresh_process(pair):
    from verispec.llamacpp import unavailable

    if unavailable() is not None:
        pytest.skip("llama.cpp does not run here")
    target, draft = pair
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "verispec",
            "generate",
            "def f(x):",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--backend",
            "llamacpp",
            "--exact-kernels",
            "off",
            "--max-new-tokens",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("6 tokens in")


def test_convert_quantizes_a_gguf_and_a_directory_with_llama_cpps_quantizer(tmp_path, capsys):
    from verispec.llamacpp import LlamaCppModel, unavailable

    if unavailable() is not None:
        pytest.skip("llama.cpp does not run here")
    from gguf import GGUFReader

    target, _ = make_toy_pair(tmp_path / "kq", sizes="kquant")
    assert main(["convert", "--model", str(target), "--out", str(tmp_path / "f32.gguf")]) == 0
    assert (
        main(["convert", "--model", str(tmp_path / "f32.gguf"), "--out", str(tmp_path / "a.gguf"), "--type", "Q4_K_M"])
        == 0
    )
    assert main(["convert", "--model", str(target), "--out", str(tmp_path / "b.gguf"), "--type", "q5_k_m"]) == 0
    types = {t.tensor_type.name for t in GGUFReader(str(tmp_path / "a.gguf")).tensors}
    assert "Q4_K" in types and {t.tensor_type.name for t in GGUFReader(str(tmp_path / "b.gguf")).tensors} >= {"Q5_K"}
    assert LlamaCppModel(tmp_path / "a.gguf", n_threads=1).vocab_size == 257
    assert (
        sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".tmp" or p.name.startswith(".")) == []
    )  # no temp files left
    assert (
        main(
            ["convert", "--model", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "c.gguf"), "--type", "q6_k"]
        )
        == 2
    )
    assert "no such GGUF file" in capsys.readouterr().err and not (tmp_path / "c.gguf").exists()


def test_a_draft_that_proposes_nothing_is_said_so(pair, capsys):
    """A draft was given but no token was proposed (issue 66): the line says 0 proposals and why,
    not "no speculation". Prompt lookup finds nothing to copy in a one-word prompt."""
    target, _ = pair
    argv = ["generate", "--prompt", "Hello", "--target", str(target), "--draft", "ngram", "--max-new-tokens", "2"]
    argv += ["--ignore-eos"]
    assert main(argv) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert "no speculation" not in line and "0 proposals in 2 target passes" in line, line
    assert "the draft had nothing to propose for 2" in line, line
