"""`verispec serve --replicas N`: engine replicas on Ray Serve behind one endpoint (server/replicas.py).

Without a cluster (fast): every replica's metrics merge into one exposition, a `replica` label
apart; the relay sends a request that received nothing to another replica and fails one that
had tokens with a retryable 503 (a JSON body, or an SSE error event when streamed); bad
`--replicas` / `--ray-address` values and a missing Ray are one line each.

On a cluster (`verispec serve --replicas 2` in a subprocess, the built-in pair): 40 concurrent
greedy requests return plain decoding's text, both replicas serve and both appear in
`/metrics`; a replica killed mid-stream fails its streams with a 503 error event while the other
streams complete unchanged, new requests succeed, and Ray brings the deployment back to 2
replicas; SIGINT stops it all with exit 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from verispec.cli import main
from verispec.config import SamplingParams
from verispec.server.metrics import Metrics
from verispec.server.replicas import merge_metrics
from verispec.stats import RequestStats

PROMPTS = [
    "def quicksort(arr):",
    "import os\n",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    "# parse the arguments\n",
    "def main():\n    ",
    "try:\n    import json",
    "x = [i * i for",
]
LONG = 96  # tokens of the streams that a replica is killed under


# ---- without a cluster


def test_every_replicas_metrics_merge_into_one_exposition():
    from prometheus_client.parser import text_string_to_metric_families

    texts = []
    for replica, reason in (("a", "length"), ("b", "stop")):
        metrics = Metrics("m", replica=replica)
        metrics.observe_pass(2, 3, [1, 3])
        metrics.observe_finished(reason, RequestStats(prompt_tokens=4, generated_tokens=9))
        texts.append(metrics.render().decode())
    merged = merge_metrics(texts).decode()
    types = [line for line in merged.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types)) == len([line for line in texts[0].splitlines() if line.startswith("# TYPE")])
    requests = {
        (s.labels["replica"], s.labels["finish_reason"]): s.value
        for family in text_string_to_metric_families(merged)
        for s in family.samples
        if s.name == "verispec_requests_total"
    }
    assert requests == {("a", "length"): 1.0, ("b", "stop"): 1.0}
    assert "replica=" not in Metrics("m").render().decode()  # one process: the output as before


class _Stream:
    """A fake streaming call: its events, then an error (or the end)."""

    def __init__(self, events, error: BaseException | None = None, block: bool = False):
        self.events, self.error, self.block, self.cancelled = list(events), error, block, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.events:
            return self.events.pop(0)
        if self.block:
            await asyncio.Event().wait()
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class _Engine:
    """A fake engine deployment handle: each `generate.remote` call takes the next stream."""

    def __init__(self, *streams: _Stream):
        self.streams, self.calls = list(streams), 0

    def options(self, stream: bool):
        return self

    @property
    def generate(self):
        return self

    def remote(self, prompt, params, logprobs):
        self.calls += 1
        return self.streams.pop(0)


def _relay(engine: _Engine, capacity: int = 4):
    from verispec.server.replicas import RemoteScheduler

    return RemoteScheduler(capacity, engine=lambda: engine)


def test_the_relay_retries_a_request_that_received_nothing_and_fails_one_that_had_tokens():
    ray_exceptions = pytest.importorskip("ray.exceptions")
    from verispec.server.replicas import ReplicaEvent
    from verispec.server.scheduler import QueueFull, Submission

    async def run(engine: _Engine, capacity: int = 4):
        scheduler, got = _relay(engine, capacity), []
        submission = Submission([1, 2], SamplingParams(temperature=0, max_new_tokens=4), got.append)
        scheduler.submit(submission)
        await asyncio.wait_for(asyncio.gather(*scheduler._tasks.values()), 5)
        return got

    died = ray_exceptions.ActorDiedError
    retried = _Engine(
        _Stream([], died()), _Stream([ReplicaEvent([5, 6], replica="b"), ReplicaEvent([7], "length", replica="b")])
    )
    assert [(e.tokens, e.finish_reason) for e in asyncio.run(run(retried))] == [([5, 6], None), ([7], "length")]
    assert retried.calls == 2

    failed = _Engine(_Stream([ReplicaEvent([5], replica="a")], died()), _Stream([]))
    events = asyncio.run(run(failed))
    assert failed.calls == 1 and events[0].tokens == [5]
    assert events[-1].finish_reason == "error" and "stopped" in events[-1].error and "retry" in events[-1].error

    async def full_then_cancel():
        blocked = _Stream([], block=True)
        scheduler = _relay(_Engine(blocked, _Stream([])), capacity=1)
        first = Submission([1], SamplingParams(temperature=0, max_new_tokens=4), lambda e: None)
        scheduler.submit(first)
        with pytest.raises(QueueFull, match="in flight"):
            scheduler.submit(Submission([1], SamplingParams(temperature=0, max_new_tokens=4), lambda e: None))
        await asyncio.sleep(0.05)
        scheduler.cancel(first)
        await asyncio.sleep(0.05)
        return blocked.cancelled, scheduler._tasks

    cancelled, left = asyncio.run(full_then_cancel())
    assert cancelled and not left


def test_a_replica_lost_mid_request_is_a_retryable_503_as_json_and_as_an_sse_event():
    ray_exceptions = pytest.importorskip("ray.exceptions")
    from fastapi.testclient import TestClient

    from verispec.models.toy import byte_level_tokenizer
    from verispec.server.app import create_app
    from verispec.server.replicas import ReplicaEvent

    tokenizer = byte_level_tokenizer()

    def client(engine: _Engine) -> TestClient:
        return TestClient(create_app(_relay(engine), tokenizer, "m", 257, 64, (256,)))

    def dying() -> _Stream:
        return _Stream([ReplicaEvent(tokenizer.encode("ab").ids, replica="a")], ray_exceptions.ActorDiedError())

    body = {"model": "m", "prompt": "hi", "max_tokens": 8}
    answer = client(_Engine(dying())).post("/v1/completions", json=body)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    error = answer.json()["error"]
    assert error["code"] == 503 and error["type"] == "server_error" and "retry" in error["message"]

    streamed = client(_Engine(dying())).post("/v1/completions", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[0]["choices"][0]["text"] == "ab"
    assert events[-1]["error"]["code"] == 503 and "retry" in events[-1]["error"]["message"]

    ok = client(
        _Engine(
            _Stream([ReplicaEvent(tokenizer.encode("ok").ids, "length", RequestStats(generated_tokens=2), replica="z")])
        )
    )
    whole = ok.post("/v1/completions", json=body).json()
    assert whole["choices"][0]["text"] == "ok" and whole["verispec"]["choices"][0]["replica"] == "z"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--replicas", "0"], "--replicas: must be an integer >= 1, got '0'"),
        (["serve", "--replicas", "two"], "--replicas: must be an integer >= 1, got 'two'"),
        (["serve", "--ray-address", "auto"], "--ray-address needs --replicas"),
    ],
)
def test_bad_replica_flags_are_one_line(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_missing_ray_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    assert main(["serve", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'verispec[ray]'" in err and len(err.strip().splitlines()) == 1, err


# ---- on a cluster: `verispec serve --replicas 2` in a subprocess


class Cluster:
    def __init__(self, url: str, process: subprocess.Popen, ray_address: str, plain: dict[str, str], log: list[str]):
        self.url, self.process, self.ray_address, self.plain, self.log = url, process, ray_address, plain, log


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _plain_texts() -> dict[int, list[int]]:
    """Plain decoding (no draft) of every prompt, LONG tokens, on the backend `serve` uses by default."""
    from verispec.engine import generate_all
    from verispec.models.backend import load, load_text_tokenizer
    from verispec.pair import TARGET_DIR

    target, _ = load(TARGET_DIR, "auto")
    tokenizer = load_text_tokenizer(TARGET_DIR, target)
    ids = generate_all(
        target,
        [tokenizer.encode(p).ids for p in PROMPTS],
        SamplingParams(temperature=0, max_new_tokens=LONG, stop_token_ids=(target.config.eos_token_id,)),
    )
    return {
        (prompt, n): tokenizer.decode(row[:n], skip_special_tokens=True)
        for prompt, row in zip(PROMPTS, ids)
        for n in (24, LONG)
    }


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray.serve")
    pytest.importorskip("httpx")
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
    }  # a local test cluster that this process can join without its token
    port, log = _free_port(), []
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "verispec.cli",
            "serve",
            "--replicas",
            "2",
            "--threads",
            "1",
            "--port",
            str(port),
            "--k",
            "3",
            "--max-batch",
            "8",
            "--max-model-len",
            "256",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    threading.Thread(target=lambda: log.extend(process.stderr), daemon=True).start()
    try:
        plain = _plain_texts()  # while Ray starts
        deadline = time.time() + 240
        while not any("verispec serve:" in line for line in log):
            assert process.poll() is None, "".join(log)
            assert time.time() < deadline, "the replicas did not come up:\n" + "".join(log)
            time.sleep(0.2)
        address = next(line for line in log if "verispec serve:" in line).split("Ray at ")[1].split(")")[0]
        yield Cluster(f"http://127.0.0.1:{port}", process, address, plain, log)
    finally:  # a test that failed before SIGINT: stop it the same way (Ray's processes go with it), kill if it hangs
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)


@pytest.fixture(scope="module")
def ray_driver(cluster):
    """This process joined to the server's cluster (to find, kill and watch replicas)."""
    import ray

    ray.init(address=cluster.ray_address, logging_level="WARNING", log_to_driver=False)
    yield ray
    if ray.is_initialized():
        ray.shutdown()


def _post(url: str, body: dict):
    import httpx

    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def _stream(url: str, body: dict, started: threading.Event | None = None) -> dict:
    """A streamed completion: its text, its error event (if any), its replica, when it ended."""
    import httpx

    text, error, replica = "", None, None
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=120,
    ) as answer:
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            if event["choices"]:
                text += event["choices"][0]["text"]
                if text and started is not None:
                    started.set()
            if "verispec" in event:
                replica = event["verispec"]["choices"][0].get("replica")
    return {"text": text, "error": error, "replica": replica, "ended": time.time()}


def _by_replica(url: str, name: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name:
                values[sample.labels["replica"]] = values.get(sample.labels["replica"], 0.0) + sample.value
    return values


def test_forty_concurrent_requests_equal_plain_decoding_and_both_replicas_serve(cluster):
    jobs = [(PROMPTS[i % len(PROMPTS)], i % 4 == 0) for i in range(40)]  # every fourth streamed

    def ask(job):
        prompt, streamed = job
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        if streamed:
            return _stream(cluster.url, body)
        answer = _post(cluster.url, body)
        assert answer.status_code == 200, answer.text
        data = answer.json()
        return {"text": data["choices"][0]["text"], "error": None, "replica": data["verispec"]["choices"][0]["replica"]}

    with ThreadPoolExecutor(max_workers=40) as pool:
        answers = list(pool.map(ask, jobs))
    assert [a["error"] for a in answers] == [None] * 40
    assert [a["text"] for a in answers] == [cluster.plain[prompt, 24] for prompt, _ in jobs]
    served = {a["replica"] for a in answers}
    assert len(served) == 2, served

    deadline = time.time() + 15  # each replica pushes its metrics every 0.5 s
    while True:
        ended = _by_replica(cluster.url, "verispec_requests_total")
        if set(ended) >= served and sum(ended.values()) >= 40 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert set(ended) >= served and all(ended[r] > 0 for r in served) and sum(ended.values()) == 40, ended


def test_a_replica_killed_mid_stream_fails_its_streams_with_503_and_the_rest_complete(cluster, ray_driver):
    from ray import serve

    started = [threading.Event() for _ in PROMPTS]
    with ThreadPoolExecutor(max_workers=len(PROMPTS) + 4) as pool:
        streams = [
            pool.submit(_stream, cluster.url, {"prompt": p, "max_tokens": LONG, "temperature": 0}, s)
            for p, s in zip(PROMPTS, started)
        ]
        assert all(s.wait(60) for s in started), "the streams did not start"
        deadline = time.time() + 10
        while (
            sum((running := _by_replica(cluster.url, "verispec_num_requests_running")).values()) < len(PROMPTS)
            and time.time() < deadline
        ):
            time.sleep(0.2)
        victim = max(running, key=running.get)  # the replica holding the most streams
        actor = next(
            a
            for a in ray_driver.util.list_named_actors(all_namespaces=True)
            if a["name"].endswith(f"VerispecEngine#{victim}")
        )
        ray_driver.kill(ray_driver.get_actor(actor["name"], namespace=actor["namespace"]))
        killed_at = time.time()
        results = [s.result(timeout=120) for s in streams]

        failed = [r for r in results if r["error"] is not None]
        done_before = [r for r in results if r["error"] is None and r["replica"] == victim and r["ended"] < killed_at]
        assert failed and len(failed) + len(done_before) == running[victim], (running, results)
        for r, prompt in zip(results, PROMPTS):
            if r["error"] is not None:
                assert r["error"]["code"] == 503 and "retry" in r["error"]["message"], r
                assert cluster.plain[prompt, LONG].startswith(r["text"])  # what it had streamed was right
            else:
                assert r["text"] == cluster.plain[prompt, LONG]
                assert r["replica"] != victim or r["ended"] < killed_at

        after = list(
            pool.map(lambda p: _post(cluster.url, {"prompt": p, "max_tokens": 24, "temperature": 0}), PROMPTS[:4])
        )
    assert [a.status_code for a in after] == [200] * 4
    assert [a.json()["choices"][0]["text"] for a in after] == [cluster.plain[p, 24] for p in PROMPTS[:4]]
    assert all(a.json()["verispec"]["choices"][0]["replica"] != victim for a in after)

    # Serve's controller may still count the killed replica as RUNNING for a moment after its actor is
    # gone, so wait until both views agree: two running replicas, two engine actors, none of them the victim.
    deadline = time.time() + 120
    while True:
        states = serve.status().applications["verispec"].deployments["VerispecEngine"].replica_states
        engines = [
            a["name"] for a in ray_driver.util.list_named_actors(all_namespaces=True) if "VerispecEngine#" in a["name"]
        ]
        replaced = len(engines) == 2 and not any(name.endswith(victim) for name in engines)
        if states == {"RUNNING": 2} and replaced or time.time() > deadline:
            break
        time.sleep(0.5)
    assert states == {"RUNNING": 2}, states
    assert replaced, (victim, engines)


def test_sigint_stops_the_replicas_and_exits_0(cluster, ray_driver):
    ray_driver.shutdown()  # this process leaves the cluster first
    assert _post(cluster.url, {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}).status_code == 200
    cluster.process.send_signal(signal.SIGINT)
    assert cluster.process.wait(timeout=90) == 0, "".join(cluster.log[-20:])
