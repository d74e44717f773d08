"""The command line: it streams text and one statistics line; bad input is one line and exit 2."""

import subprocess
import sys

import pytest

from verispec.cli import main
from verispec.models.toy import make_toy_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_toy_pair(tmp_path_factory.mktemp("toy"))


def test_generate_streams_text_and_a_statistics_line(pair, capsys):
    target, draft = pair
    code = main(["generate", "def f(x):", "--target", str(target), "--draft", str(draft), "--k", "3", "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "1"])
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
    assert "no speculation" in plain[-1] and "alpha_hat" in spec[-1]
    assert plain[:-1] == spec[:-1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "hi", "--target", "/nonexistent/dir"], "no config.json"),
        (["generate", "hi", "--target", "{target}", "--top-p", "1.5"], "top_p"),
        (["generate", "hi", "--target", "{target}", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--target", "{target}", "--max-new-tokens", "0"], "max_new_tokens"),
        (["generate", "hi", "--target", "{target}", "--draft", "{target}", "--k", "-2"], "k must be"),
        (["generate", "hi", "--target", "{target}", "--dtype", "int3"], "dtype"),
        (["generate", "--target", "{target}"], "no prompt"),
        (["generate", "hi", "--k", "x"], "--k"),
        (["generate", "hi", "--target", "{target}", "--draft", "{target}", "--k", "auto", "--k-max", "0"], "k_max"),
        (["generate", "hi", "--target", "{target}", "--max-new-tokens", "100000"], "context of 2048 positions"),
        (["generate", "hi", "--target", "{target}", "--backend", "onnx"], "--backend"),
        (["generate", "hi", "--target", "{target}", "--gguf-type", "q2_k"], "--gguf-type"),
        (["convert", "--model", "/nonexistent/dir", "--out", "/tmp/x.gguf"], "no config.json"),
        (["profile", "--target", "{target}", "--context", "100000"], "context of 2048 positions"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(pair, capsys, argv, message):
    argv = [a.format(target=pair[0]) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors leave through SystemExit
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("verispec: error:") and message in err


def test_prompt_lookup_drafter_from_the_command_line(pair, capsys):
    target, _ = pair
    assert main(["generate", "ab ab ab ab", "--target", str(target), "--draft", "ngram", "--max-new-tokens", "10", "--ignore-eos"]) == 0
    assert "alpha_hat" in capsys.readouterr().out.splitlines()[-1]


def test_early_exit_drafter_from_the_command_line(pair, capsys):
    target, _ = pair
    common = ["generate", "def f(x):", "--target", str(target), "--max-new-tokens", "12", "--ignore-eos", "--k", "2"]  # auto may not draft
    assert main(common + ["--draft", "early-exit:2"]) == 0
    spec = capsys.readouterr().out.splitlines()
    assert main(common) == 0
    assert capsys.readouterr().out.splitlines()[:-1] == spec[:-1] and "alpha_hat" in spec[-1]
    assert main(common + ["--draft", "early-exit:x"]) == 2
    assert "early-exit:L" in capsys.readouterr().err


def test_k_auto_runs_and_reports(pair, capsys):
    target, draft = pair
    assert main(["generate", "x = 1", "--target", str(target), "--draft", str(draft), "--k", "auto", "--max-new-tokens", "20", "--ignore-eos"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("20 tokens in")


def test_console_script_runs_in_a_subprocess(pair):
    result = subprocess.run(
        [sys.executable, "-m", "verispec.cli", "generate", "x", "--target", str(pair[0]), "--max-new-tokens", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "3 tokens in" in result.stdout
