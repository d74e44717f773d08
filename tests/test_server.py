"""`verispec serve` end to end: a real server on 127.0.0.1 (an ephemeral port) over the built-in
pair on the default backend, driven by the official `openai` client and by raw HTTP.

- the openai client: completions, streaming (the streamed text equals the whole), n > 1, usage;
- no cross-talk: 32 concurrent greedy requests each return the tokens of plain decoding of
  their prompt (generate_all without a draft) while sampled requests with random settings run
  beside them; a seeded sampled request returns the same text alone and under load;
- bad input: a table of malformed requests, each a 4xx naming the problem, then a fuzz run of
  random bodies (no 5xx, the server still answers, a control request unchanged);
- disconnects: dropped streams leave no running row within a second.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from verispec.config import SamplingParams
from verispec.drafters.model import ModelDrafter
from verispec.engine import generate_all
from verispec.models.backend import load, load_text_tokenizer
from verispec.pair import DRAFT_DIR, TARGET_DIR
from verispec.policy import FixedLength

MAX_MODEL_LEN = 256
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


class Running:
    """The built-in pair behind a server in a thread of this process (server/run.py)."""

    def __init__(self, target, draft, tokenizer, k=3, max_batch=8):
        from verispec.server.run import build, start_in_thread

        eos = (target.config.eos_token_id,)
        self.app, self.scheduler = build(
            target,
            ModelDrafter(draft),
            tokenizer,
            model_name="pair",
            k=FixedLength(k),
            max_batch=max_batch,
            max_waiting=64,
            max_model_len=MAX_MODEL_LEN,
            eos=eos,
        )
        self.handle = start_in_thread(self.app)
        self.url = self.handle.url

    def stop(self):
        self.handle.stop()


@pytest.fixture(scope="module")
def pair():
    target, _ = load(TARGET_DIR, "auto")
    draft, _ = load(DRAFT_DIR, "auto")
    return target, draft, load_text_tokenizer(TARGET_DIR, target)


@pytest.fixture(scope="module")
def server(pair):
    running = Running(*pair)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _plain(pair, text: str, max_tokens: int) -> str:
    target, _, tokenizer = pair
    ids = generate_all(
        target,
        [tokenizer.encode(text).ids],
        SamplingParams(temperature=0, max_new_tokens=max_tokens, stop_token_ids=(target.config.eos_token_id,)),
    )[0]
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_the_openai_client_completes_streams_and_takes_n(pair, client):
    whole = client.completions.create(model="pair", prompt=PROMPTS[0], max_tokens=32, temperature=0)
    assert whole.choices[0].text == _plain(pair, PROMPTS[0], 32)
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.prompt_tokens == len(pair[2].encode(PROMPTS[0]).ids)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.model_extra["verispec"]["choices"][0]["proposed"] > 0

    pieces, ends = [], []
    for chunk in client.completions.create(model="pair", prompt=PROMPTS[0], max_tokens=32, temperature=0, stream=True):
        pieces.append(chunk.choices[0].text)
        ends.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == whole.choices[0].text and len(pieces) > 2
    assert ends[-1] == whole.choices[0].finish_reason and not any(ends[:-1])

    several = client.completions.create(model="pair", prompt=PROMPTS[:2], max_tokens=12, temperature=1.0, n=3, seed=7)
    assert sorted(c.index for c in several.choices) == list(range(6))
    assert len({c.text for c in several.choices[:3]}) > 1  # the n choices of a prompt are different draws
    generated = [c["generated_tokens"] for c in several.model_extra["verispec"]["choices"]]
    assert several.usage.completion_tokens == sum(generated)
    assert all(n == 12 for n, c in zip(generated, several.choices) if c.finish_reason == "length")
    again = client.completions.create(model="pair", prompt=PROMPTS[:2], max_tokens=12, temperature=1.0, n=3, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in several.choices]  # a seed fixes every choice

    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="pair", prompt=PROMPTS[0], max_tokens=MAX_MODEL_LEN)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt=PROMPTS[0])


def _post(url: str, body, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def test_no_cross_talk_under_load(pair, server):
    greedy = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), 24) for i in range(32)]
    rng = random.Random(3)
    noise = [
        {
            "prompt": rng.choice(PROMPTS),
            "max_tokens": rng.randint(4, 40),
            "temperature": rng.choice([0.5, 1.0, 1.5]),
            "top_p": rng.choice([1.0, 0.9]),
            "top_k": rng.choice([0, 20]),
            "seed": rng.randrange(10**6),
        }
        for _ in range(16)
    ]
    seeded = {"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 1.0, "seed": 1234}
    alone = _post(server.url, seeded).json()["choices"][0]["text"]
    with ThreadPoolExecutor(max_workers=48) as pool:
        jobs = [pool.submit(_post, server.url, body) for body in noise]
        loaded = pool.submit(_post, server.url, seeded)  # joins when a row frees, among rows of other settings
        jobs += [pool.submit(_post, server.url, {"prompt": p, "max_tokens": n, "temperature": 0}) for p, n in greedy]
        answers = [job.result() for job in jobs]
    answers = answers[len(noise) :] + answers[: len(noise)]  # the greedy ones first
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200][:1]
    for (prompt, n), answer in zip(greedy, answers):
        assert answer.json()["choices"][0]["text"] == _plain(pair, prompt, n), prompt
    assert loaded.result().json()["choices"][0]["text"] == alone


BAD = [
    ("not json", b'{"prompt": ', 400, "not valid JSON"),
    ("not utf-8", b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("a list body", [1, 2], 400, "JSON object"),
    ("a string body", "hello", 400, "JSON object"),
    ("no prompt", {"max_tokens": 4}, 400, "'prompt' is required"),
    ("empty prompt", {"prompt": ""}, 400, "empty string"),
    ("empty list", {"prompt": []}, 400, "'prompt' is empty"),
    ("empty id list", {"prompt": [[]]}, 400, "empty list"),
    ("prompt a number", {"prompt": 5}, 400, "'prompt' must be"),
    ("prompt mixed", {"prompt": ["a", 3]}, 400, "'prompt' must be"),
    ("token out of range", {"prompt": [1, 99999]}, 400, "token ids are integers"),
    ("negative token", {"prompt": [-1]}, 400, "token ids are integers"),
    ("too many prompts", {"prompt": ["a"] * 65}, 400, "at most 64"),
    ("max_tokens string", {"prompt": "a", "max_tokens": "9"}, 400, "'max_tokens' must be an integer"),
    ("max_tokens zero", {"prompt": "a", "max_tokens": 0}, 400, "'max_tokens' must be in"),
    ("max_tokens float", {"prompt": "a", "max_tokens": 2.5}, 400, "'max_tokens' must be an integer"),
    ("beyond the context", {"prompt": "a", "max_tokens": MAX_MODEL_LEN}, 400, "exceeds the context"),
    ("long prompt", {"prompt": list(range(1, 300))}, 400, "context holds"),
    ("temperature string", {"prompt": "a", "temperature": "hot"}, 400, "'temperature' must be a number"),
    ("temperature negative", {"prompt": "a", "temperature": -1}, 400, "'temperature' must be in"),
    ("temperature huge", {"prompt": "a", "temperature": 5}, 400, "'temperature' must be in"),
    ("top_p zero", {"prompt": "a", "top_p": 0}, 400, "'top_p' must be in"),
    ("top_p above one", {"prompt": "a", "top_p": 1.5}, 400, "'top_p' must be in"),
    ("top_k negative", {"prompt": "a", "top_k": -5}, 400, "'top_k' must be in"),
    ("top_k bool", {"prompt": "a", "top_k": True}, 400, "'top_k' must be an integer"),
    ("min_p above one", {"prompt": "a", "min_p": 2}, 400, "'min_p' must be in"),
    ("seed string", {"prompt": "a", "seed": "x"}, 400, "'seed' must be an integer"),
    ("seed float", {"prompt": "a", "seed": 1.5}, 400, "'seed' must be an integer"),
    ("seed negative", {"prompt": "a", "seed": -1}, 400, "'seed' must be an integer in [0, 2**63)"),
    ("seed too large", {"prompt": "a", "seed": 2**63}, 400, "'seed' must be an integer in [0, 2**63)"),
    ("n zero", {"prompt": "a", "n": 0}, 400, "'n' must be in"),
    ("n too large", {"prompt": "a", "n": 100}, 400, "'n' must be in"),
    ("stop a number", {"prompt": "a", "stop": 3}, 400, "'stop' must be"),
    ("too many stops", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ("empty stop", {"prompt": "a", "stop": [""]}, 400, "'stop' string"),
    ("stream string", {"prompt": "a", "stream": "yes"}, 400, "'stream' must be a boolean"),
    ("stream options", {"prompt": "a", "stream": True, "stream_options": {"x": 1}}, 400, "'stream_options'"),
    ("unknown field", {"prompt": "a", "temprature": 0.5}, 400, "unrecognized request argument 'temprature'"),
    ("unknown model", {"prompt": "a", "model": "gpt-4"}, 404, "does not exist"),
    ("model a number", {"prompt": "a", "model": 3}, 400, "'model' must be a string"),
    ("echo", {"prompt": "a", "echo": True}, 400, "'echo' is not supported"),
    ("logprobs too many", {"prompt": "a", "logprobs": 6}, 400, "'logprobs' must be in"),
    ("logprobs a string", {"prompt": "a", "logprobs": "2"}, 400, "'logprobs' must be an integer"),
    ("best_of", {"prompt": "a", "best_of": 3}, 400, "'best_of'"),
    ("penalty", {"prompt": "a", "presence_penalty": 1.0}, 400, "'presence_penalty'"),
    ("sampling mode", {"prompt": "a", "sampling": "magic"}, 400, "'sampling' must be one of"),
    ("nan temperature", b'{"prompt": "a", "temperature": NaN}', 400, "'temperature' must be a number"),
]


def test_malformed_requests_get_a_4xx_naming_the_problem(server):
    for name, body, status, message in BAD:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        answer = httpx.post(
            server.url + "/v1/completions", content=content, headers={"content-type": "application/json"}, timeout=30
        )
        assert answer.status_code == status, (name, answer.status_code, answer.text)
        error = answer.json()["error"]
        assert message in error["message"], (name, error)
        assert error["type"] and "message" in error
    too_large = httpx.post(
        server.url + "/v1/completions", content=b'{"prompt": "' + b"a" * (1 << 21) + b'"}', timeout=30
    )
    assert too_large.status_code == 413 and "larger than" in too_large.json()["error"]["message"]
    chat = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30
    )
    assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/nothing", timeout=30).status_code == 404
    assert len(BAD) >= 30


def _random_value(rng: random.Random, depth: int = 0):
    kinds = (
        ["int", "float", "str", "bool", "none", "list", "dict", "big"]
        if depth < 2
        else ["int", "float", "str", "bool", "none"]
    )
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, 1, -1, 7, 255, 8191, 8192, 2**31, -(2**40)])
    if kind == "float":
        return rng.choice([0.0, 0.5, 1.0, -0.1, 1e300, 2.0000001])
    if kind == "str":
        return rng.choice(
            [
                "",
                "a",
                "def f(",
                "\u0000",
                "\ud800x".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
                "🙂" * 3,
            ]
        )
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "big":
        return "x" * rng.randint(1000, 5000)
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["a", "prompt", "n"]): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def test_a_fuzz_run_of_random_bodies_never_gets_a_5xx(server):
    rng = random.Random(11)
    fields = [
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stream",
        "n",
        "model",
        "sampling",
        "logprobs",
        "echo",
        "best_of",
        "stream_options",
        "bogus",
    ]
    control = {"prompt": PROMPTS[3], "max_tokens": 12, "temperature": 0}
    expected = _post(server.url, control).json()["choices"][0]["text"]
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=60) as http:
        for i in range(2000):
            if rng.random() < 0.1:
                content = bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
            else:
                body = {name: _random_value(rng) for name in rng.sample(fields, rng.randint(0, 6))}
                if rng.random() < 0.5:
                    body.setdefault("prompt", rng.choice(PROMPTS))
                if body.get("max_tokens") is None or not isinstance(body.get("max_tokens"), int):
                    body["max_tokens"] = rng.choice([1, 2, 3])  # valid ones finish quickly
                content = json.dumps(body).encode()
            answer = http.post(
                server.url + "/v1/completions", content=content, headers={"content-type": "application/json"}
            )
            statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
            assert answer.status_code < 500, (content[:200], answer.status_code, answer.text[:300])
    assert statuses.get(200, 0) > 20 and sum(v for s, v in statuses.items() if 400 <= s < 500) > 1000, statuses
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert _post(server.url, control).json()["choices"][0]["text"] == expected


def _running(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("verispec_num_requests_running"):
            return float(line.split()[-1])
    raise AssertionError("no verispec_num_requests_running in /metrics")


def test_dropped_streams_free_their_rows_within_a_second(server):
    import gc
    import tracemalloc

    def drop_ten_streams() -> None:
        clients = [httpx.Client(timeout=60) for _ in range(10)]
        streams = []
        for http, prompt in zip(clients, PROMPTS + PROMPTS):
            opened = http.stream(
                "POST",
                server.url + "/v1/completions",
                json={"prompt": prompt, "max_tokens": 200, "temperature": 0.7, "stream": True},
            )
            response = opened.__enter__()
            lines = response.iter_lines()
            while not next(lines).startswith("data: {"):  # the first chunk has arrived: the request runs
                pass
            streams.append((opened, response))
        assert _running(server.url) > 0
        for (opened, response), http in zip(streams, clients):
            response.close()  # the client goes away mid-stream
            http.close()
        deadline = time.time() + 1.0
        while _running(server.url) > 0 and time.time() < deadline:
            time.sleep(0.02)
        assert _running(server.url) == 0
        assert len(server.scheduler.batch) == 0 and not server.scheduler.waiting

    drop_ten_streams()  # warm up (allocators, connection pools)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(5):  # 50 streams, 10 at a time
        drop_ten_streams()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert after - before < 1_000_000, after - before  # no per-request state left behind (Python objects, bytes)
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_logprobs_are_the_targets_log_probabilities_of_the_returned_tokens(pair, client):
    import torch

    target, _, tokenizer = pair
    whole = client.completions.create(model="pair", prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=2)
    logprobs = whole.choices[0].logprobs
    assert (
        len(logprobs.token_logprobs)
        == whole.usage.completion_tokens
        == len(logprobs.tokens)
        == len(logprobs.top_logprobs)
    )
    assert "".join(logprobs.tokens) == whole.choices[0].text
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    prompt = tokenizer.encode(PROMPTS[1]).ids
    generated = tokenizer.encode(whole.choices[0].text).ids
    with torch.no_grad():
        reference = torch.log_softmax(
            target(torch.tensor([prompt + generated]))[0, len(prompt) - 1 : -1].float(), dim=-1
        )
    for j, (chosen, top) in enumerate(zip(logprobs.token_logprobs, logprobs.top_logprobs)):
        assert len(top) == 2 and chosen == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the most likely token
        assert chosen == pytest.approx(float(reference[j].max()), abs=2e-3)
    streamed = []
    for chunk in client.completions.create(
        model="pair", prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=2, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(logprobs.token_logprobs, abs=1e-6)


CHATML = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_chat_completions_render_the_models_template(pair, tmp_path):
    from verispec.server.chat import load_chat_template, render
    from verispec.server.run import build, start_in_thread

    target, draft, tokenizer = pair
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|endoftext|>"}))
    template = load_chat_template(tmp_path)
    assert template == (CHATML, {"bos_token": "", "eos_token": "<|endoftext|>"})
    assert load_chat_template(TARGET_DIR) is None  # the built-in pair has none
    app, _ = build(
        target,
        ModelDrafter(draft),
        tokenizer,
        model_name="pair",
        k=FixedLength(3),
        max_batch=4,
        max_model_len=MAX_MODEL_LEN,
        eos=(target.config.eos_token_id,),
        chat_template=template,
    )
    running = start_in_thread(app)
    try:
        chat = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=60)
        messages = [
            {"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def quicksort(arr):"},
        ]
        answer = chat.chat.completions.create(model="pair", messages=messages, max_tokens=16, temperature=0)
        rendered = render(CHATML, template[1], messages)
        assert answer.choices[0].message.content == _plain(pair, rendered, 16)
        assert answer.choices[0].message.role == "assistant" and answer.object == "chat.completion"
        assert answer.usage.prompt_tokens == len(tokenizer.encode(rendered).ids)
        pieces = [
            c.choices[0].delta.content or ""
            for c in chat.chat.completions.create(
                model="pair", messages=messages, max_tokens=16, temperature=0, stream=True
            )
            if c.choices
        ]
        assert "".join(pieces) == answer.choices[0].message.content
        for body, message in [
            ({"messages": []}, "non-empty list"),
            ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
            ({"messages": [{"role": "user", "content": 5}]}, "content"),
            ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
        ]:
            refused = httpx.post(running.url + "/v1/chat/completions", json=body, timeout=30)
            assert refused.status_code == 400 and message in refused.json()["error"]["message"], (body, refused.text)
    finally:
        running.stop()


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_serve_from_the_command_line_answers_then_stops_cleanly_on_a_signal(signal_name):
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "verispec.cli",
            "serve",
            "--port",
            str(port),
            "--k",
            "2",
            "--max-batch",
            "2",
            "--max-model-len",
            "256",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.time() + 120
        while True:
            assert process.poll() is None, process.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "the server did not come up"
            time.sleep(0.2)
        answer = _post(url, {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] > 0
        process.send_signal(getattr(signal, signal_name))
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_run_makes_every_pass_on_the_thread_that_loaded_the_models(pair):
    """run() (what `verispec serve` calls) keeps the scheduler's loop on its own thread and
    uvicorn on another: llama.cpp's OpenMP then keeps one team of threads in the process (a
    second one made every pass wait on futex wake-ups: 16 ms a token instead of 10, f32 pair)."""
    import os
    import signal
    import threading

    from verispec.server.run import build, listen, run

    target, draft, tokenizer = pair
    app, scheduler = build(
        target, ModelDrafter(draft), tokenizer, model_name="pair", k=FixedLength(2), max_batch=2,
        max_model_len=MAX_MODEL_LEN, eos=(target.config.eos_token_id,),
    )  # fmt: skip
    passes_on: set[int] = set()
    original = scheduler._pass
    scheduler._pass = lambda: (passes_on.add(threading.get_ident()), original())[1]
    sock = listen("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    answers = []

    def client() -> None:
        try:
            deadline = time.time() + 60
            while time.time() < deadline:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            answers.append(_post(url, {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}).status_code)
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=client, daemon=True).start()
    run(app, "127.0.0.1", 0, sock)
    assert answers == [200]
    assert passes_on == {threading.get_ident()}, "passes ran on another thread than run()'s"


def test_a_long_prompt_is_read_in_pieces_between_the_running_requests_passes(pair):
    import threading

    from verispec.server.metrics import Metrics
    from verispec.server.scheduler import Scheduler, Submission

    target, draft, tokenizer = pair
    metrics = Metrics("pair")
    scheduler = Scheduler(
        target,
        ModelDrafter(draft),
        FixedLength(3),
        max_batch=4,
        max_waiting=8,
        max_model_len=MAX_MODEL_LEN,
        metrics=metrics,
        prefill_chunk=32,
    )
    scheduler.start()
    try:

        def submit(prompt: list[int], max_tokens: int):
            tokens, done, first = [], threading.Event(), threading.Event()

            def on_event(event):
                tokens.extend(event.tokens)
                first.set()
                if event.finish_reason:
                    done.set()

            submission = Submission(
                prompt, SamplingParams(temperature=0, max_new_tokens=max_tokens, stop_token_ids=()), on_event
            )
            scheduler.submit(submission)
            return submission, tokens, done, first

        running = submit(tokenizer.encode(PROMPTS[0]).ids, 150)
        running[3].wait(30)
        long_prompt = (tokenizer.encode("\n".join(PROMPTS * 4)).ids * 3)[:200]
        passes_before = scheduler.passes
        submission, tokens, done, _ = submit(long_prompt, 8)
        assert done.wait(60) and running[2].wait(60)
        chunks = -(-(len(long_prompt) - 1) // 32)  # 7
        assert metrics.prefill_chunks._value.get() == chunks
        assert (
            submission.joined_pass - passes_before >= chunks - 1
        )  # the running request's passes went on between the pieces
        plain = generate_all(
            target,
            [long_prompt, tokenizer.encode(PROMPTS[0]).ids],
            [SamplingParams(temperature=0, max_new_tokens=n) for n in (8, 150)],
        )
        assert tokens == plain[0] and running[1] == plain[1]
    finally:
        scheduler.stop()


def test_a_full_queue_answers_503_at_once_and_the_rest_complete(pair):
    from verispec.server.run import build, start_in_thread

    target, draft, tokenizer = pair
    app, _ = build(
        target,
        ModelDrafter(draft),
        tokenizer,
        model_name="pair",
        k=FixedLength(3),
        max_batch=1,
        max_waiting=1,
        max_model_len=MAX_MODEL_LEN,
        eos=(target.config.eos_token_id,),
    )
    running = start_in_thread(app)
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            answers = list(
                pool.map(
                    lambda i: _post(running.url, {"prompt": PROMPTS[i], "max_tokens": 48, "temperature": 0}), range(8)
                )
            )
        busy = [a for a in answers if a.status_code == 503]
        assert busy and all("busy" in a.json()["error"]["message"] for a in busy)
        assert all(a.status_code in (200, 503) for a in answers) and any(a.status_code == 200 for a in answers)
        assert httpx.get(running.url + "/health", timeout=30).status_code == 200
    finally:
        running.stop()


def test_auto_is_calibrated_before_the_first_request_and_serves_the_same_tokens(pair):
    """`--k auto`: the scheduler times passes at every batch size and k before it takes a
    request (analysis.profile.calibrate), leaves its batch empty, and then serves plain decoding's tokens."""
    from verispec.policy import AdaptiveLength
    from verispec.server.run import build, start_in_thread

    target, draft, tokenizer = pair
    policy = AdaptiveLength(k_max=4)
    app, scheduler = build(
        target,
        ModelDrafter(draft),
        tokenizer,
        model_name="pair",
        k=policy,
        max_batch=4,
        max_model_len=MAX_MODEL_LEN,
        eos=(target.config.eos_token_id,),
    )
    assert not policy.shape.target and not policy.shape.draft
    handle = start_in_thread(app)
    try:
        assert scheduler.calibration_s is not None and len(scheduler.batch) == 0
        assert set(policy.shape.target) == {b * (k + 1) for b in (1, 2, 4) for k in range(5)}
        assert set(policy.shape.draft) == {(b, k) for b in (1, 2, 4) for k in range(1, 5)}
        assert policy.passes == 0  # no request yet: nothing timed in service
        assert policy.acceptance() == 0.7 and not policy.text.rows  # the calibration's text is not the users'
        got = _post(handle.url, {"model": "pair", "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}).json()
        assert "choices" in got, got
        assert got["choices"][0]["text"] == _plain(pair, PROMPTS[0], 24)
    finally:
        handle.stop()


def test_bench_serve_writes_json_csv_and_a_plot_with_ratios_measured_in_the_same_rounds(tmp_path):
    """`verispec bench-serve` end to end on the toy pair: servers for plain, k = 2 and auto, each
    in a process of its own, two levels, one warm-up round at each, then two sweeps of one measured
    round at every level; every level and mode has its medians over the measured rounds, no
    errors, the ratios to plain and to the best other mode, and the CSV and the plot are written;
    the warm-up rounds are in the JSON, marked."""
    from verispec.cli import main
    from verispec.models.toy import make_toy_pair

    target, draft = make_toy_pair(tmp_path / "pair")
    out = {name: tmp_path / f"serve.{name}" for name in ("json", "csv", "png")}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    code = main(
        [
            "bench-serve",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--backend",
            "torch",
            "--modes",
            "plain,2,auto",
            "--concurrency",
            "1,3",
            "--requests",
            "3",
            "--max-new-tokens",
            "6",
            "--repeats",
            "2",
            "--warmups",
            "1",
            "--max-batch",
            "4",
            "--k-max",
            "3",
            "--prompts",
            str(prompts),
            "--json",
            str(out["json"]),
            "--csv",
            str(out["csv"]),
            "--plot",
            str(out["png"]),
        ]
    )
    assert code == 0
    report = json.loads(out["json"].read_text())
    assert len(report["levels"]) == 2 * 3 * 3 and all(level["errors"] == 0 for level in report["levels"])
    assert [level["warmup"] for level in report["levels"]] == [True] * 6 + [
        False
    ] * 12  # the warm-up rounds of every level first
    assert [level["concurrency"] for level in report["levels"]] == [1] * 3 + [3] * 3 + (
        [1] * 3 + [3] * 3
    ) * 2  # then sweeps over the levels
    at_one = [level["mode"] for level in report["levels"] if level["concurrency"] == 1]
    assert at_one == [
        "plain",
        "k=2",
        "k=auto",
        "k=2",
        "k=auto",
        "plain",
        "k=auto",
        "plain",
        "k=2",
    ]  # each round of a level starts one mode later
    medians = {(row["mode"], row["concurrency"]): row for row in report["medians"]}
    assert set(medians) == {(mode, c) for mode in ("plain", "k=2", "k=auto") for c in (1, 3)}
    for (mode, c), row in medians.items():
        assert (
            row["repeats"] == 2
            and row["throughput_tok_s"] > 0
            and "throughput_vs_best_other" in row
            and "throughput_vs_best_other_by_round" in row
        )
        assert ("throughput_vs_plain" in row) == (mode != "plain")
    header = out["csv"].read_text().splitlines()[0].split(",")
    assert {
        "mode",
        "concurrency",
        "throughput_tok_s",
        "throughput_vs_plain",
        "throughput_vs_best_other",
        "itl_p99_s",
    } <= set(header)
    assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summarize_gives_a_bootstrap_interval_for_the_ratio_to_the_best_other_mode():
    """With rounds that do not vary, the 95% interval of the ratio to the best other mode is that
    ratio exactly; with rounds that scatter, it is wider and holds the ratio; with two rounds, none."""
    from verispec.server.loadgen import Level, summarize

    def rows_of(rounds: list[dict]) -> dict:
        return {
            row["mode"]: row
            for row in summarize(
                [Level(m, 2, 8, t, 1.0, 0.1, 0.2, 0.01, 0.02, 0.01, 0) for r in rounds for m, t in r.items()]
            )
        }

    steady = rows_of([{"auto": 100, "a": 110, "b": 90}] * 6)["auto"]
    assert steady["throughput_vs_best_other"] == pytest.approx(100 / 110)
    assert (
        steady["throughput_vs_best_other_ci95_low"]
        == steady["throughput_vs_best_other_ci95_high"]
        == pytest.approx(100 / 110)
    )
    draw = random.Random(1)
    noisy = rows_of(
        [
            {"auto": 100 * draw.uniform(0.9, 1.1), "a": 105 * draw.uniform(0.9, 1.1), "b": 95 * draw.uniform(0.9, 1.1)}
            for _ in range(9)
        ]
    )["auto"]
    low, high = noisy["throughput_vs_best_other_ci95_low"], noisy["throughput_vs_best_other_ci95_high"]
    assert low < noisy["throughput_vs_best_other"] < high and high - low > 0.05
    assert "throughput_vs_best_other_ci95_low" not in rows_of([{"auto": 100, "a": 110}] * 2)["auto"]


def test_summarize_compares_with_the_best_other_mode_by_medians_and_by_rounds():
    """Three rounds at one level: 'auto' serves 100 tokens/s every round; 'a', 'b' and 'c' 90,
    each but in the round where it happens to serve 120. Against the best other mode by median
    ('a', the first of three alike), round by round, auto is at the median of 100/120, 100/90,
    100/90: 100/90; against the fastest other of each round (some rival at 120 in every round), 100/120."""
    from verispec.server.loadgen import Level, summarize

    def level(mode: str, throughput: float) -> Level:
        return Level(mode, 4, 8, throughput, 1.0, 0.1, 0.2, 0.01, 0.02, 0.01, 0)

    rounds = [
        {"auto": 100, "a": 120, "b": 90, "c": 90},
        {"auto": 100, "a": 90, "b": 120, "c": 90},
        {"auto": 100, "a": 90, "b": 90, "c": 120},
    ]
    rows = {row["mode"]: row for row in summarize([level(m, t) for r in rounds for m, t in r.items()])}
    assert rows["auto"]["throughput_vs_best_other"] == pytest.approx(100 / 90)
    assert rows["auto"]["throughput_vs_best_other_by_round"] == pytest.approx(100 / 120)
    assert rows["a"]["throughput_vs_best_other"] == pytest.approx(90 / 100)
    assert rows["a"]["throughput_vs_best_other_by_round"] == pytest.approx(
        90 / 120
    )  # median of 120/100, 90/120, 90/120
    warm = [
        Level(m, 4, 8, t, 1.0, 0.1, 0.2, 0.01, 0.02, 0.01, 0, warmup=True)
        for m, t in {"auto": 10, "a": 500, "b": 1, "c": 1}.items()
    ]
    again = {row["mode"]: row for row in summarize(warm + [level(m, t) for r in rounds for m, t in r.items()])}
    assert again == rows  # a warm-up round moves no median and no ratio
    counted = [dataclasses.replace(lv, warmup=False) for lv in warm]
    assert {
        row["mode"]: row for row in summarize(counted + [level(m, t) for r in rounds for m, t in r.items()])
    } != rows  # counted, it would


def test_a_lone_surrogate_in_a_prompt_or_a_message_is_a_400_naming_it(pair):
    """JSON's escapes can spell a lone surrogate ("\\ud800"), which is not Unicode text: no
    tokenizer takes it. Every such string is refused at the door, naming where it is."""
    from verispec.server.run import build, start_in_thread

    target, draft, tokenizer = pair
    app, _ = build(
        target,
        ModelDrafter(draft),
        tokenizer,
        model_name="pair",
        k=FixedLength(3),
        max_batch=2,
        max_model_len=MAX_MODEL_LEN,
        eos=(target.config.eos_token_id,),
        chat_template=(CHATML, {}),
    )
    running = start_in_thread(app)
    try:
        for route, body, param, where in [
            ("completions", b'{"prompt": "def f(\\ud800):"}', "prompt", "'prompt'"),
            ("completions", b'{"prompt": ["ok", "\\udfff"]}', "prompt", "'prompt[1]'"),
            ("completions", b'{"prompt": "a", "stop": ["\\ud83d"]}', "stop", "'stop[0]'"),
            ("completions", b'{"prompt": "a", "model": "\\ud800"}', "model", "'model'"),
            (
                "chat/completions",
                b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
                "messages",
                "'messages[0].content'",
            ),
            (
                "chat/completions",
                (
                    b'{"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": '
                    b'[{"type": "text", "text": "\\udc00"}]}]}'
                ),
                "messages",
                "'messages[1].content[0].text'",
            ),
        ]:
            answer = httpx.post(
                f"{running.url}/v1/{route}", content=body, headers={"content-type": "application/json"}, timeout=30
            )
            assert answer.status_code == 400, (body, answer.status_code, answer.text)
            error = answer.json()["error"]
            assert error["param"] == param and where in error["message"] and "surrogate" in error["message"], (
                body,
                error,
            )
        assert _post(running.url, {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}).status_code == 200
    finally:
        running.stop()


def _serve_process(flags: list[str], port: int, stderr):
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-m", "verispec.cli", "serve", *flags, "--host", "127.0.0.1", "--port", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )


def test_sigint_ends_every_open_stream_with_a_final_chunk_and_done(tmp_path):
    """Ctrl-C while streams are open: each choice of each stream gets its last chunk (what was
    left of its text, finish_reason "abort"), then `data: [DONE]`; the process exits 0 and prints
    no traceback."""
    import contextlib
    import signal
    import socket

    from verispec.models.toy import make_toy_pair

    target, draft = make_toy_pair(tmp_path / "pair")
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(
        json.dumps({**config, "eos_token_id": None})
    )  # no end of text: streams run until stopped
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        process = _serve_process(
            [
                "--target",
                str(target),
                "--draft",
                str(draft),
                "--backend",
                "torch",
                "--k",
                "2",
                "--max-batch",
                "4",
                "--max-model-len",
                "2048",
            ],
            port,
            stderr,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert process.poll() is None, log.read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert time.time() < deadline, "the server did not come up"
            time.sleep(0.2)
        bodies = [
            {"prompt": PROMPTS[0], "max_tokens": 2000, "temperature": 0, "stream": True},
            {"prompt": PROMPTS[1], "max_tokens": 2000, "temperature": 0.8, "seed": 1, "n": 2, "stream": True},
        ]
        with contextlib.ExitStack() as stack:
            http = stack.enter_context(httpx.Client(timeout=httpx.Timeout(30.0)))
            streams = [stack.enter_context(http.stream("POST", url + "/v1/completions", json=body)) for body in bodies]
            lines = [stream.iter_lines() for stream in streams]
            events: list[list[str]] = [[], []]
            for i, it in enumerate(lines):  # every stream has begun
                events[i].append(next(line for line in it if line))
            process.send_signal(signal.SIGINT)
            ends = time.time() + 30
            for i, it in enumerate(lines):
                for line in it:
                    if line:
                        events[i].append(line)
                    assert time.time() < ends, "a stream did not end"
        for body, stream_events in zip(bodies, events):
            assert stream_events[-1] == "data: [DONE]", stream_events[-3:]
            chunks = [json.loads(e.removeprefix("data: ")) for e in stream_events[:-1]]
            assert all("error" not in c for c in chunks), chunks[-1]
            finished = {
                c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
                for c in chunks
                if c["choices"][0]["finish_reason"]
            }
            assert finished == dict.fromkeys(range(body.get("n", 1)), "abort"), finished
        assert process.wait(timeout=30) == 0
        assert "Traceback" not in log.read_text(), log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_port_in_use_fails_before_the_banner_with_one_line_naming_it():
    """`serve` binds its port before it loads the models: a port in use is one line naming it,
    exit 2, and no ready line."""
    import socket
    import subprocess

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = _serve_process(["--k", "2", "--max-batch", "2", "--max-model-len", "256"], port, subprocess.PIPE)
        try:
            _, stderr = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    lines = stderr.decode().strip().splitlines()
    assert process.returncode == 2 and len(lines) == 1, stderr.decode()
    assert (
        lines[0].startswith("verispec: error:")
        and "--port" in lines[0]
        and str(port) in lines[0]
        and "in use" in lines[0]
    )


def test_the_server_and_the_command_line_take_the_librarys_seed_range(server, capsys):
    """A seed is an integer in [0, 2**63) everywhere: SamplingParams, a request's "seed" (400
    naming it outside) and `generate --seed` (one line naming --seed, exit 2, before any model
    is loaded)."""
    from verispec.cli import main, parse_args

    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**63)
    for seed in (0, 2**63 - 1):
        assert _post(server.url, {"prompt": PROMPTS[0], "max_tokens": 2, "seed": seed}).status_code == 200
        assert parse_args(["generate", "x", "--seed", str(seed)]).seed == seed
    for seed in (-1, 2**63, -(2**63), 2**64 - 1):
        answer = _post(server.url, {"prompt": PROMPTS[0], "max_tokens": 2, "seed": seed})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "seed", answer.text
        try:
            code = main(["generate", "x", "--seed", str(seed), "--max-new-tokens", "1"])
        except SystemExit as exit_:
            code = exit_.code
        assert code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "--seed" in lines[0] and "2**63" in lines[0], lines
