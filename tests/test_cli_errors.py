"""Bad input on the command line: one line on stderr naming what is wrong, exit 2, no
traceback, and no file changed. Lengths past the model's context fail at once under a memory
limit, and a long context that the model does allow is read in memory linear in its length."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from verispec.cli import main
from verispec.models.toy import make_toy_pair


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The toy pair and the input files the cases refer to, by name."""
    root = tmp_path_factory.mktemp("inputs")
    target, draft = make_toy_pair(root / "pair")
    (root / "number.jsonl").write_text(json.dumps({"prompt": 42}) + "\n")
    (root / "garbled.jsonl").write_text("{not json\n")
    (root / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    (root / "empty.jsonl").write_text("\n")
    (root / "bad_row.jsonl").write_text(
        json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b", "top_p": 2}) + "\n"
    )
    (root / "typo.jsonl").write_text(json.dumps({"prompt": "a", "temprature": 0.5}) + "\n")
    (root / "good.jsonl").write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    (root / "plain.txt").write_text("not a model\n")
    (root / "outdir").mkdir()
    return {"target": str(target), "draft": str(draft), "root": str(root), **{p.stem: str(p) for p in root.iterdir()}}


T = ["--target", "{target}", "--backend", "torch"]  # a loaded target: the toy pair on torch (no GGUF cache written)
G = ["generate", "hi", *T]
B = ["bench", "--prompts", "{good}", *T, "--draft", "{draft}"]

# (argv, what the one line must contain, standard input or None)
CASES = [
    # generate: values
    (["generate", "hi", "--target", "/nonexistent/dir"], "no such file or directory", None),
    (["generate", "hi", "--target", "{plain}"], "a file, not a model directory", None),
    ([*G, "--top-p", "1.5"], "--top-p", None),
    ([*G, "--top-k", "-3"], "--top-k", None),
    ([*G, "--min-p", "2"], "--min-p", None),
    ([*G, "--temperature", "-1"], "--temperature must be a finite number >= 0", None),
    ([*G, "--temperature", "warm"], "--temperature", None),
    ([*G, "--max-new-tokens", "0"], "--max-new-tokens", None),
    ([*G, "--max-new-tokens", "100000"], "context of 2048 positions", None),
    ([*G, "--draft", "{draft}", "--k", "-2"], "--k must be an integer in [0, 64]", None),
    ([*G, "--k", "x"], "--k", None),
    ([*G, "--draft", "{draft}", "--k", "auto", "--k-max", "0"], "--k-max", None),
    ([*G, "--dtype", "int3"], "dtype", None),
    ([*G, "--backend", "onnx"], "--backend", None),
    ([*G, "--gguf-type", "q9_k"], "--gguf-type", None),
    ([*G, "--threads", "0"], "--threads", None),
    ([*G, "--device", "tpu"], "--device", None),
    ([*G, "--device", "cuda"], "no CUDA device", None),
    ([*G, "--confidence-threshold", "1.5"], "--confidence-threshold", None),
    ([*G, "--stop", ""], "--stop", None),
    ([*G, "--stop", "\\u12"], "--stop \\u12: \\u needs four hex digits", None),
    ([*G, "--draft", "/nonexistent/draft"], "no such file or directory", None),
    ([*G, "--draft", "early-exit:x"], "layer count", None),
    ([*G, "--draft", "early-exit:9"], "early exit takes 1 to 3", None),
    # generate: flags that contradict each other
    ([*G, "--no-speculation", "--k", "4"], "--no-speculation decodes without a draft, so --k 4 contradicts it", None),
    ([*G, "--draft", "{draft}", "--k", "4", "--k-max", "2"], "--k 4 is above --k-max 2", None),
    (["generate", "hi", "--target", "{root}/model.gguf", "--gguf-type", "q8_0"], "--gguf-type q8_0: the target", None),
    (
        ["profile", "--target", "{root}/model.gguf", "--draft", "{root}/d.gguf", "--gguf-type", "q8_0"],
        "is a GGUF file, whose type is its own",
        None,
    ),
    # generate: prompts
    (["generate", *T], "no prompt", None),
    (["generate", "hi", "--prompt", "ho", *T], "give one of PROMPT, --prompt and --prompts", None),
    (["generate", "--prompts", "{number}", *T], 'a "prompt" string', None),
    (["generate", "--prompts", "{garbled}", *T], 'a "prompt" string', None),
    (["generate", "--prompts", "{latin1}", *T], "not UTF-8", None),
    (["generate", "--prompts", "{empty}", *T], "no prompts", None),
    (["generate", "--prompts", "{bad_row}", *T], "bad_row.jsonl:2: top_p must be in (0, 1]", None),
    (["generate", "--prompts", "{typo}", *T], 'typo.jsonl:1: unknown key "temprature"', None),
    (["generate", "--prompts", "/nonexistent/prompts.jsonl", *T], "No such file", None),
    (["generate", "caf\udce9", *T], "not valid UTF-8", None),  # undecodable argv bytes arrive as lone surrogates
    (["generate", "-", *T], "standard input is not UTF-8", b"caf\xe9"),
    ([*G, "--json", "/nonexistent/dir/out.json"], "no directory", None),
    ([*G, "--json", "{outdir}"], "is a directory", None),
    # bench: checked before any work
    ([*B, "--k", "abc"], "--k", None),
    ([*B, "--k", "0"], "lengths must be >= 1", None),
    ([*B, "--temperature", "x"], "--temperature", None),
    ([*B, "--temperature", "-1"], "--temperature", None),
    ([*B, "--json", "/nonexistent/dir/b.json"], "--json", None),
    ([*B, "--csv", "{outdir}"], "--csv", None),
    ([*B, "--plot-dir", "{plain}"], "--plot-dir", None),
    ([*B, "--plot-dir", "{plain}/plots"], "plain.txt is a file, not a directory", None),
    ([*B, "--max-prompts", "0"], "--max-prompts", None),
    ([*B, "--repeats", "0"], "--repeats", None),
    (["bench", "--prompts", "{number}", *T, "--draft", "{draft}"], 'a "prompt" string', None),
    (["bench", *T], "--prompts", None),
    ([*B[:-2], "--draft", "none"], "bench measures a draft against its target, so --draft none leaves nothing", None),
    (["bench", "--prompts", "{good}", *T, "--draft", "none"], "so --draft none leaves nothing to measure", None),
    ([*B, "--peer", "vllm"], "invalid choice", None),
    ([*B, "--top-p", "0"], "--top-p must be in (0, 1]", None),
    ([*B, "--seed", "0,x"], "--seed: must be comma-separated integers", None),
    ([*B, "--draft-temperature", "2"], "--draft-temperature: must be 'auto' or a number in [0, 1]", None),
    ([*B, "--seed", "0,1"], "--seed takes several seeds only with --peer llamacpp, got 0,1", None),
    ([*B, "--peer", "llamacpp", "--seed", "4294967295"], "llama.cpp's seeds are integers in [0, 2**32 - 1)", None),
    ([*B, "--peer", "llamacpp", "--temperature", "0,1"], "--peer llamacpp runs one --temperature at a time", None),
    ([*B, "--peer", "hf", "--draft", "suffix"], "it does not take --draft suffix", None),
    ([*B, "--peer", "hf", "--draft", "suffix+{draft}"], "it does not take --draft suffix+", None),
    ([*G, "--draft", "suffix+none"], "a combined draft is 'ngram+MODEL' or 'suffix+MODEL'", None),
    ([*G, "--draft", "lookup+{draft}"], "a combined draft is 'ngram+MODEL' or 'suffix+MODEL'", None),
    # plan, profile
    (["plan", "--prompts", "{good}", *T, "--draft", "{draft}", "--k-max", "0"], "--k-max", None),
    (["plan", "--prompts", "{garbled}", *T, "--draft", "{draft}"], 'a "prompt" string', None),
    (["plan", "--prompts", "{good}", *T, "--draft", "{draft}", "--draft", "none"], "plan measures a draft", None),
    (["check", *T, "--draft", "none"], "check measures a draft against its target, so --draft none", None),
    (
        ["plan", "--json", "/nonexistent/dir/p.json", "--prompts", "{good}", *T, "--draft", "{draft}"],
        "--json /nonexistent/dir/p.json: no directory",
        None,
    ),
    (["profile", *T, "--context", "100000"], "context of 2048 positions", None),
    (["profile", *T, "--k-max", "0"], "--k-max", None),
    (["profile", *T, "--repeats", "0"], "--repeats", None),
    (["profile", *T, "--draft", "ngram"], "--draft ngram: profile times a draft model's passes", None),
    (["profile", *T, "--draft", "suffix"], "--draft suffix: profile times a draft model's passes", None),
    (["profile", *T, "--draft", "ngram+{draft}"], "profile times a draft model's passes", None),
    (["profile", *T, "--draft", "early-exit:2"], "--draft early-exit:2: profile times a draft model's passes", None),
    # convert, quantize, train, the command itself
    (["convert", "--model", "/nonexistent/dir", "--out", "{root}/x.gguf"], "no such file or directory", None),
    (["convert", "--model", "{target}", "--out", "/nonexistent/dir/x.gguf"], "--out", None),
    (["convert", "--model", "{target}", "--out", "{root}/x.gguf", "--type", "q9_k"], "invalid choice", None),
    (["quantize", "--model", "{target}", "--out", "{root}/q", "--bits", "3"], "invalid choice", None),
    (
        ["quantize", "--model", "{target}", "--out", "{root}/q", "--bits", "4", "--group-size", "48"],
        "--group-size",
        None,
    ),
    (["quantize", "--model", "{target}", "--out", "{plain}"], "a file, not a directory", None),
    (["quantize", "--model", "{target}", "--out", "{plain}/q"], "plain.txt is a file, not a directory", None),
    (["train", "target", "--preset", "tiny", "--out", "{plain}/run"], "--out {plain}/run: ", None),
    (["train", "data", "--data", "{plain}/data"], "--data {plain}/data: ", None),
    (["toy", "{plain}/toy"], "OUT {plain}/toy: ", None),
    (["train", "target", "--preset", "huge"], "--preset", None),
    (["train", "draft"], "--teacher", None),
    (["perplexity", "--model", "{target}"], "--data runs/data: no held-out split", None),
    (["perplexity", "--model", "{target}", "--data", "{root}"], "no held-out split (heldout.bin)", None),
    (["frobnicate"], "invalid choice", None),
    # bench-serve: checked before any server starts
    (["bench-serve", *T, "--concurrency", "0,2"], "--concurrency", None),
    (["bench-serve", *T, "--concurrency", "1,x"], "--concurrency", None),
    (["bench-serve", "--url", "http://192.0.2.1:8000"], "--url must be a server on this machine", None),
    (["bench-serve", *T, "--modes", "plain,fast"], "--modes", None),
    (["bench-serve", *T, "--json", "/nonexistent/dir/s.json"], "--json", None),
    (["bench-serve", "--target", "/nonexistent/model", "--modes", "plain"], "did not start: /nonexistent/model", None),
    (["bench-serve", *T, "--peer", "llama-server"], "--peer llama-server and --llama-cpp-bin DIR go together", None),
    (["bench-serve", *T, "--llama-cpp-bin", "{root}"], "--peer llama-server and --llama-cpp-bin DIR go together", None),
    (["bench-serve", *T, "--peer", "llamacpp"], "invalid choice", None),
    (["bench-serve", *T, "--peer", "llama-server", "--llama-cpp-bin", "{root}"], "no llama-server there", None),
    (
        ["bench-serve", *T, "--peer", "llama-server", "--llama-cpp-bin", "{root}", "--peer-draft-n", "4,0"],
        "--peer-draft-n must list integers >= 1",
        None,
    ),
    (
        ["bench-serve", "--url", "http://127.0.0.1:9", "--peer", "llama-server", "--llama-cpp-bin", "{root}"],
        "it does not take --url",
        None,
    ),
]


def _snapshot(*roots: str) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns) for root in roots for p in Path(root).rglob("*") if p.is_file()
    }


class _Stdin:
    def __init__(self, data: bytes):
        self.buffer = io.BytesIO(data)


def test_the_table_is_long_enough():
    assert len(CASES) >= 40


@pytest.mark.parametrize("argv, message, stdin", CASES, ids=[" ".join(case[0])[:60] for case in CASES])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(files, tmp_path, monkeypatch, capsys, argv, message, stdin):
    monkeypatch.chdir(tmp_path)
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", _Stdin(stdin))
    before = _snapshot(files["root"], tmp_path)
    try:
        code = main([a.format(**files) for a in argv])
    except SystemExit as exit_:  # argparse's own errors leave through SystemExit
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.err.count("\n") == 1 and captured.err.startswith("verispec: error:"), captured.err
    assert message.format(**files) in captured.err and "Traceback" not in captured.err
    assert _snapshot(files["root"], tmp_path) == before


READ_ONLY = [
    (["generate", "hi", *T, "--json", "{ro}/g.json"], "--json"),
    (["plan", "--prompts", "{good}", *T, "--json", "{ro}/p.json"], "--json"),
    ([*B, "--csv", "{ro}/b.csv"], "--csv"),
    (["check", *T, "--draft", "{draft}", "--json", "{ro}/c.json"], "--json"),
    (["convert", "--model", "{target}", "--out", "{ro}/m.gguf"], "--out"),
    (["quantize", "--model", "{target}", "--out", "{ro}/q"], "--out"),
    (["train", "target", "--preset", "tiny", "--out", "{ro}/run"], "--out"),
    (["toy", "{ro}/toy"], "OUT"),
]


@pytest.mark.parametrize("argv, flag", READ_ONLY, ids=[case[0][0] for case in READ_ONLY])
def test_an_output_in_a_read_only_place_fails_before_any_work(files, tmp_path, monkeypatch, capsys, argv, flag):
    """A directory this process may not write (os.access says no: root may write anywhere but on
    a read-only mount, so the test plays one): one line naming the flag, before anything loads."""
    import os

    read_only = tmp_path / "ro"
    read_only.mkdir()
    access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode, **kw: not Path(path).is_relative_to(read_only) and access(path, mode, **kw)
    )
    monkeypatch.chdir(tmp_path)
    assert main([a.format(**files, ro=read_only) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag} {read_only}/" in err and err.rstrip().endswith("not writable"), err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("verispec 0.")


_LIMITED = (
    "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({0}, {0})); "
    "from verispec.cli import main; sys.exit(main(sys.argv[1:]))"
)
LIMIT = 6 << 30  # bytes of address space: torch's import needs about 2 GB of it; a dense 100000^2 mask needs 40 GB


@pytest.mark.parametrize("argv", [["generate", "hi", "--max-new-tokens", "100000"], ["profile", "--context", "100000"]])
def test_lengths_past_the_context_fail_at_once_under_a_memory_limit(files, argv):
    done = subprocess.run(
        [sys.executable, "-c", _LIMITED.format(LIMIT), *argv, *[a.format(**files) for a in T]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "context of 2048 positions" in done.stderr


def test_a_long_context_the_model_allows_is_read_in_linear_memory(files, tmp_path):
    """profile --context 30000 on a toy model whose config allows it: under the memory limit (a
    dense mask of the whole prefill would need 30000^2 x 4 bytes x 4 heads = 14 GB), it runs."""
    long = Path(files["target"]).parent / "long"
    if not long.exists():
        long.mkdir()
        for item in Path(files["target"]).iterdir():
            (long / item.name).write_bytes(item.read_bytes())
        config = json.loads((long / "config.json").read_text())
        config["max_position_embeddings"] = 40000
        (long / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _LIMITED.format(LIMIT),
            "profile",
            "--target",
            str(long),
            "--backend",
            "torch",
            "--context",
            "30000",
            "--k-max",
            "1",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
