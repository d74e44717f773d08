"""`verispec bench-serve --peer llama-server` (server/peer.py, server/loadgen.py): the command line
given to llama.cpp's server, the request fields under which it samples as verispec does, the
parse of each stream's draft counts, the request-by-request comparison of completions, and the
round-by-round life of its servers, driven against a stand-in program that speaks its API (CI
has no llama.cpp programs). The real llama-server runs only where VERISPEC_LLAMA_CPP_BIN names a
directory holding it."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from verispec.llamacpp.lib import extra_buffers_fault
from verispec.server import peer
from verispec.server.loadgen import Level, bench_serve, draft_counts, summarize

# llama-server's last chunk of a streamed /v1/completions, as it writes it (this llama.cpp version)
LLAMA_SERVER_LAST = {
    "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
    "object": "text_completion",
    "usage": {"completion_tokens": 8, "prompt_tokens": 3, "total_tokens": 11},
    "timings": {"prompt_n": 3, "predicted_n": 8, "predicted_per_second": 12.7, "draft_n": 11, "draft_n_accepted": 2},
}
VERISPEC_LAST = {
    "choices": [],
    "usage": {"completion_tokens": 8, "prompt_tokens": 3, "total_tokens": 11},
    "verispec": {"choices": [{"index": 0, "proposed": 12, "accepted": 7}, {"index": 1, "proposed": 4, "accepted": 1}]},
}


def test_the_command_line_runs_the_same_files_with_a_slot_per_request_and_the_draft_at_its_length():
    target, draft = Path("/m/target.gguf"), Path("/m/draft.gguf")
    plain = peer.command(target, slots=4, threads=2, context=2048)
    base = ["-m", str(target), "-np", "4", "-c", "8192", "-t", "2", "--no-cache-prompt", "--no-webui"]
    assert plain == base + (["--no-repack"] if extra_buffers_fault() else [])  # as llama-cpp-python runs here
    drafted = peer.command(target, slots=1, threads=3, context=512, draft=draft, draft_n=6)
    assert drafted[:8] == ["-m", str(target), "-np", "1", "-c", "512", "-t", "3"]
    assert drafted[drafted.index("-md") + 1] == str(draft)
    assert drafted[drafted.index("--spec-type") + 1] == "draft-simple"  # without it llama-server would not draft
    assert drafted[drafted.index("--spec-draft-n-max") + 1] == "6"
    assert "-md" not in plain and "--spec-type" not in plain
    with pytest.raises(ValueError, match="draft length"):
        peer.command(target, 1, 2, 512, draft=draft)
    with pytest.raises(ValueError, match="draft model"):
        peer.command(target, 1, 2, 512, draft_n=4)


def test_modes_are_plain_then_one_per_draft_length_and_plain_only_without_a_draft_model(tmp_path):
    (tmp_path / "llama-server").write_text("")
    found = peer.modes(tmp_path, Path("t.gguf"), Path("d.gguf"), [2, 8], threads=2, context=64, temperature=1.0)
    assert list(found) == ["llama-server plain", "llama-server k=2", "llama-server k=8"]
    assert [m.draft_n for m in found.values()] == [None, 2, 8] and found["llama-server k=8"].draft == Path("d.gguf")
    assert all(m.body == peer.UNFILTERED for m in found.values())
    assert "-np 3 " in " ".join(found["llama-server k=2"].flags(3)) + " "
    assert list(peer.modes(tmp_path, Path("t.gguf"), None, [2, 8], 2, 64, 0.0)) == ["llama-server plain"]
    with pytest.raises(ValueError, match="no llama-server there"):
        peer.modes(tmp_path / "elsewhere", Path("t.gguf"), None, [2], 2, 64, 0.0)


def test_requests_sample_unfiltered_at_a_temperature_and_carry_nothing_more_when_greedy():
    assert peer.request_fields(0.0) == {}
    assert peer.request_fields(1.0) == {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}


@pytest.mark.parametrize(
    "text, lengths", [("2,4,8", [2, 4, 8]), ("4", [4]), ("4,4,2", [4, 2]), ("0", None), ("x", None), ("", None)]
)
def test_draft_lengths_parse_or_fail_naming_the_flag(text, lengths):
    if lengths is None:
        with pytest.raises(ValueError, match="--peer-draft-n"):
            peer.parse_draft_lengths(text)
    else:
        assert peer.parse_draft_lengths(text) == lengths


def test_draft_counts_are_read_from_either_server_and_absent_where_none_drafted():
    assert draft_counts(LLAMA_SERVER_LAST) == (11, 2)
    assert draft_counts(VERISPEC_LAST) == (16, 8)
    plain = {**LLAMA_SERVER_LAST, "timings": {"prompt_n": 3, "predicted_n": 8}}  # llama-server without a draft
    assert draft_counts(plain) is None
    assert draft_counts({"choices": [{"text": "a"}]}) is None


def test_model_context_is_the_gguf_training_context(tmp_path):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_context_length(1234)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert peer.model_context(tmp_path / "m.gguf") == 1234


def _level(mode: str, throughput: float, texts: list, drafted: int = 0, accepted: int = 0) -> Level:
    return Level(
        mode, 2, len(texts), throughput, 1.0, 0.1, 0.2, 0.01, 0.02, 0.01, 0, False, drafted, accepted, 30, texts
    )


def test_completions_are_compared_request_by_request_and_ratios_taken_to_the_peers_best():
    """Two rounds; 'auto' differs from llama-server plain on one request of the first round (the
    negative control: it is counted as not identical), a failed request (None) is not compared;
    its ratio to the peer's best is to llama-server k=4, the faster peer mode by median, and the
    peer's own modes get no such ratio."""
    same = ["a", "b", "c"]
    rounds = [
        [
            _level("auto", 100, ["a", "B", "c"], 20, 15),
            _level("llama-server plain", 80, same),
            _level("llama-server k=4", 90, same, 40, 10),
        ],
        [
            _level("auto", 110, ["a", "b", None], 20, 13),
            _level("llama-server plain", 85, same),
            _level("llama-server k=4", 100, same, 40, 10),
        ],
    ]
    rows = {
        row["mode"]: row for row in summarize([lv for r in rounds for lv in r], "llama-server", "llama-server plain")
    }
    auto = rows["auto"]
    assert (auto["identical_to"], auto["identical_requests"], auto["compared_requests"]) == ("llama-server plain", 4, 5)
    assert rows["llama-server k=4"]["identical_requests"] == rows["llama-server k=4"]["compared_requests"] == 6
    assert "identical_to" not in rows["llama-server plain"]  # the reference itself
    assert auto["throughput_vs_peer_best"] == pytest.approx((100 / 90 + 110 / 100) / 2)
    assert "throughput_vs_peer_best" not in rows["llama-server plain"]
    assert auto["alpha_hat"] == pytest.approx(28 / 40) and rows["llama-server k=4"]["alpha_hat"] == 0.25
    assert "alpha_hat" not in rows["llama-server plain"]
    no_reference = {row["mode"]: row for row in summarize([lv for r in rounds for lv in r])}
    assert "identical_to" not in no_reference["auto"] and "throughput_vs_peer_best" not in no_reference["auto"]


FAKE = '''#!{python}
"""A stand-in for llama-server: /health, and /v1/completions streamed as llama-server streams it
(its last chunk with usage and, with -md, timings.draft_n); every start, request and stop logged."""
import json, os, signal, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
log = os.environ["FAKE_LLAMA_SERVER_LOG"]


def note(event, **fields):
    with open(log, "a") as out:
        out.write(json.dumps({{"event": event, "pid": os.getpid(), **fields}}) + "\\n")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{{"status": "ok"}}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        note("request", body=body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        pieces = ["x%d" % t for t in body["prompt"]][: body["max_tokens"]]
        for piece in pieces:
            chunk = {{"choices": [{{"text": piece, "index": 0}}]}}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\\n\\n")
        last = {{"choices": [{{"text": "", "index": 0, "finish_reason": "length"}}],
                "usage": {{"completion_tokens": len(pieces), "prompt_tokens": len(body["prompt"])}},
                "timings": {{"predicted_n": len(pieces)}}}}
        if "-md" in argv:
            last["timings"].update(draft_n=4, draft_n_accepted=3)
        self.wfile.write(b"data: " + json.dumps(last).encode() + b"\\n\\ndata: [DONE]\\n\\n")


server = ThreadingHTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler)
note("start", argv=argv)
signal.signal(signal.SIGINT, lambda *_: (note("stop"), os._exit(0)))
server.serve_forever()
'''


def test_each_round_starts_its_own_server_with_a_slot_per_request_and_stops_it(tmp_path, monkeypatch):
    """bench_serve over three llama-server modes (a stand-in program) at concurrency 1 and 2: each
    round starts the mode's server with -np = the level's concurrency and stops it before the
    next starts (never two at once); every request carries the prompt's token ids and the
    unfiltered sampler; acceptance comes from the last chunk's timings; every completion arrives."""
    program = tmp_path / "llama-server"
    program.write_text(FAKE.format(python=sys.executable))
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_SERVER_LOG", str(log))
    modes = peer.modes(tmp_path, Path("t.gguf"), Path("d.gguf"), [2, 5], threads=2, context=64, temperature=1.0)
    prompts = [[5, 6, 7], [8, 9]]
    levels = bench_serve(modes, prompts, [1, 2], 3, 4, 1.0, 1)
    assert [(lv.mode, lv.concurrency) for lv in levels] == [
        ("llama-server plain", 1),
        ("llama-server k=2", 1),
        ("llama-server k=5", 1),
        ("llama-server plain", 2),
        ("llama-server k=2", 2),
        ("llama-server k=5", 2),
    ]
    assert all(lv.errors == 0 and lv.requests == 3 for lv in levels)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    lives = [e for e in events if e["event"] != "request"]
    assert [e["event"] for e in lives] == ["start", "stop"] * 6  # one server at a time
    assert all(a["pid"] == b["pid"] for a, b in zip(lives[::2], lives[1::2]))
    starts = [e["argv"] for e in lives[::2]]
    for argv, level in zip(starts, levels):
        assert argv[argv.index("-np") + 1] == str(level.concurrency)
        assert ("-md" in argv) == (level.mode != "llama-server plain")
        if level.mode != "llama-server plain":
            assert argv[argv.index("--spec-draft-n-max") + 1] == level.mode.removeprefix("llama-server k=")
    bodies = [e["body"] for e in events if e["event"] == "request"]
    assert len(bodies) == 18 and all(b["prompt"] in prompts and b["top_k"] == 0 and b["min_p"] == 0 for b in bodies)
    for lv in levels:
        assert lv.texts == ["x5x6x7", "x8x9", "x5x6x7"] and lv.prompt_tokens == 8
        assert (lv.drafted, lv.accepted) == ((0, 0) if lv.mode == "llama-server plain" else (12, 9))
    assert not any(m._handle for m in modes.values())


def test_a_server_that_does_not_start_is_one_error_naming_it_and_its_last_words(tmp_path):
    program = tmp_path / "llama-server"
    program.write_text(f"#!{sys.executable}\nprint('main: error loading model t.gguf'); raise SystemExit(1)\n")
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    modes = peer.modes(tmp_path, Path("t.gguf"), None, [2], threads=2, context=64, temperature=0.0)
    with pytest.raises(RuntimeError, match=r"`llama-server -m t.gguf .*` did not start: main: error loading model"):
        bench_serve(modes, [[1, 2]], [1], 1, 4, 0.0, 1)


@pytest.mark.skipif(
    not (
        os.environ.get("VERISPEC_LLAMA_CPP_BIN")
        and Path(os.environ["VERISPEC_LLAMA_CPP_BIN"], "llama-server").is_file()
    ),
    reason="VERISPEC_LLAMA_CPP_BIN names no directory holding llama.cpp's llama-server",
)
def test_the_real_llama_server_beside_verispec_greedy_gives_the_same_completions(tmp_path):
    """The whole command on the built-in pair, small: verispec plain and llama-server plain and
    drafting, greedy; every completion identical to llama-server plain's, and llama-server's
    acceptance read."""
    pytest.importorskip("llama_cpp")
    from verispec.cli import main

    out = tmp_path / "report.json"
    argv = ["bench-serve", "--peer", "llama-server", "--llama-cpp-bin", os.environ["VERISPEC_LLAMA_CPP_BIN"]]
    argv += ["--modes", "plain", "--peer-draft-n", "3", "--concurrency", "2", "--requests", "4"]
    argv += ["--max-new-tokens", "16", "--warmups", "0", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    rows = {row["mode"]: row for row in report["medians"]}
    assert report["peer_commands"]["llama-server k=3"][-1] == "3"  # --spec-draft-n-max 3
    assert set(rows) == {"plain", "llama-server plain", "llama-server k=3"}
    for mode in ("plain", "llama-server k=3"):
        assert rows[mode]["identical_requests"] == rows[mode]["compared_requests"] == 4, rows[mode]
    assert 0 < rows["llama-server k=3"]["alpha_hat"] <= 1 and rows["plain"]["errors"] == 0
    assert rows["plain"]["prompt_tokens"] == rows["llama-server plain"]["prompt_tokens"]  # the same prompt tokens


def test_a_server_that_closes_the_connection_is_an_error_not_a_crash():
    """A peer that dies mid-request (httpx's RemoteProtocolError) counts as one failed request."""
    import asyncio

    import httpx

    from verispec.server import loadgen

    class Closing:
        def stream(self, *args, **kwargs):
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

    assert asyncio.run(loadgen._one(Closing(), "http://127.0.0.1:1", {})) is None
