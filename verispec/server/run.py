"""Putting the server together and running it: `build` (scheduler, metrics, app over loaded
models), `listen` (host:port bound before the models load) and `run` (uvicorn on host:port
until SIGINT or SIGTERM; on the signal the scheduler stops at once, so the requests it held
end: a stream with its last chunk and [DONE], any other with a retryable 503; then the
connections close and the thread is joined). `load_served` turns a Settings (assemble.py)
into `ServedModels`, in this process or in each Ray replica (replicas.py); `model_len` is the
context rule both use. `Running` is a server in a thread of this process
(tests), `Spawned` one in a process of its own (bench-serve's servers under test).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from .app import create_app
from .metrics import Metrics
from .scheduler import Scheduler


@dataclass
class ServedModels:
    """A server's models and what the API says of them (`load_served`)."""

    target: object
    tokenizer: object
    drafter: object | None
    k: object  # an int or a DraftLengthPolicy
    eos: tuple[int, ...]
    name: str
    chat_template: tuple[str, dict] | None


def load_served(settings, model_name: str | None = None, say=None) -> ServedModels:
    """The models of an assemble.Settings as a server uses them, its chat template, and the name
    the API gives them (`model_name`, else the target's directory or file name). Start-up notes
    go to `say` (default: stderr)."""
    from ..assemble import load_parts, to_stderr
    from .chat import load_chat_template

    parts = load_parts(settings, say or to_stderr())
    target = parts.settings.target
    return ServedModels(
        parts.target,
        parts.tokenizer,
        parts.drafter,
        parts.policy,
        parts.eos,
        model_name or Path(target).name,
        load_chat_template(target),
    )


def model_len(target, max_model_len: int | None) -> int:
    """Prompt + max_tokens per request at most: the given value (checked against the target's
    context), or the context itself (2048 when the model does not say)."""
    context = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    if max_model_len is None:
        max_model_len = context if isinstance(context, int) else 2048
    if isinstance(context, int) and max_model_len > context:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's context of {context} positions")
    return max_model_len


def build(
    target,
    drafter,
    tokenizer,
    *,
    model_name: str,
    k,
    max_batch: int = 8,
    max_waiting: int = 64,
    max_model_len: int | None = None,
    eos: tuple[int, ...] = (),
    chat_template: tuple[str, dict] | None = None,
    prefill_chunk: int = 256,
):
    """(app, scheduler) over loaded models; the scheduler's thread starts with the app (lifespan)."""
    max_model_len = model_len(target, max_model_len)
    metrics = Metrics(model_name)
    scheduler = Scheduler(target, drafter, k, max_batch, max_waiting, max_model_len, metrics, prefill_chunk)
    app = create_app(
        scheduler, tokenizer, model_name, target.vocab_size, max_model_len, eos, metrics, chat_template=chat_template
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app.router.lifespan_context = lifespan
    app.state.scheduler = scheduler  # run() runs its loop on the main thread and stops it on SIGINT or SIGTERM
    return app, scheduler


def listen(host: str, port: int):
    """A socket bound to host:port for `run` (which listens on it), so that the command can bind
    before it loads the models: a port in use is then one line naming it, not an error after the
    ready line. ValueError naming --port (or --host) when it cannot be bound."""
    import errno
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait for TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: {host}:{port} is already in use (another server?)") from None
        raise ValueError(f"cannot listen on {host}:{port} (--host, --port): {error.strerror or error}") from None
    return sock


def run(app, host: str, port: int, sock=None) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully and return: the command exits 0.
    The scheduler's loop runs on this thread, the one that loaded the models, and uvicorn on a
    thread of its own: llama.cpp's OpenMP then has one team of threads in the process
    (Scheduler.start says what a second costs). The signal first stops the scheduler: every
    request it holds ends at once, a stream with its last chunk (finish_reason "abort") and
    [DONE]; then uvicorn closes the connections (5 s at most for open streams). A second signal
    cuts them. `sock`: one from `listen`, bound already (else uvicorn binds host:port)."""
    import signal
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # this process's main thread handles them (below)
            yield

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5))
    scheduler = getattr(app.state, "scheduler", None)

    def on_signal(sig, frame) -> None:
        if server.should_exit:
            server.force_exit = True
        if scheduler is not None:
            scheduler.stop(timeout=0)
        server.should_exit = True

    def serve_http() -> None:
        try:
            server.run(sockets=None if sock is None else [sock])
        finally:  # uvicorn ended (a signal, or its start-up failed): so does the loop
            if scheduler is not None:
                scheduler.stop(timeout=0)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    http = threading.Thread(target=serve_http, name="verispec-http", daemon=True)
    try:
        if scheduler is not None:
            scheduler.claim()  # before uvicorn's start-up (lifespan) calls scheduler.start()
        http.start()
        if scheduler is not None:
            scheduler.run_here()  # until a signal stops it (or the engine fails: requests then get 503s)
        while http.is_alive():
            http.join(0.5)
    finally:
        server.should_exit = True
        http.join(10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if scheduler is not None and scheduler.error is not None and not server.started:
        raise RuntimeError(f"the scheduler could not start: {scheduler.error}") from scheduler.error


class Running:
    """A server in a thread of this process, on 127.0.0.1 and a free port (`url`); `stop()`."""

    def __init__(self, app, timeout: float = 60.0):
        import threading
        import time

        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, name="verispec-server", daemon=True)
        self.thread.start()
        deadline = time.time() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def start_in_thread(app) -> Running:
    return Running(app)


class Spawned:
    """`verispec serve FLAGS` in a process of its own on 127.0.0.1 and a free port (`url`), ready
    (its /health answers, so a `--k auto` server has calibrated) when the constructor returns;
    `stop()` sends SIGINT and waits. bench-serve measures servers this way: a server in the load
    generator's process would share its interpreter lock, and every streamed token the load
    generator reads would delay the server's next pass. `program` runs another server that takes
    the same --host and --port and answers /health alike (llama.cpp's llama-server, peer.py)."""

    def __init__(self, flags: list[str], timeout: float = 600.0, program: list[str] | None = None):
        import subprocess
        import sys
        import tempfile
        import time

        program = program or [sys.executable, "-m", "verispec", "serve"]
        name = "verispec serve" if len(program) > 1 else Path(program[0]).name
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name.replace(' ', '-')}-", suffix=".log", delete=False)  # noqa: SIM115  (closed by stop)
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [*program, *flags, "--host", "127.0.0.1", "--port", str(port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while not _healthy(self.url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                reason = (
                    _last_line(self.log.name).removeprefix("verispec: error: ")
                    or f"no answer on {self.url}/health within {timeout:.0f} s"
                )
                self.stop()
                raise RuntimeError(f"`{name} {' '.join(flags)}` did not start: {reason}")
            time.sleep(0.2)

    def stop(self) -> None:
        import os
        import signal
        import subprocess

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log.name)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _last_line(path: str) -> str:
    with open(path, errors="replace") as log:
        lines = [line.strip() for line in log if line.strip()]
    return lines[-1] if lines else ""
