"""Many engines behind one endpoint: `verispec serve --replicas N` on Ray Serve.

Owns the Ray Serve application: `EngineReplica` (a deployment of N replicas; each loads the
models itself through the `Plan`'s loader, runs its own `Scheduler` and streams a request's
`Event`s from `generate`), the ingress (one replica running app.py's FastAPI app over a
`RemoteScheduler`, which relays each submission to one engine replica), the metrics hub (a
plain Ray actor to which every engine replica pushes its Prometheus text; the ingress's
`/metrics` merges them, each series labelled with its `replica`), and `serve_until_signal`
(start or join Ray, deploy, wait for SIGINT or SIGTERM, shut down).

Routing is Ray Serve's own (power of two choices on the replicas' queue lengths). One
`generate` call is one request's whole life, so a request, streamed or not, stays on one
replica; the n choices of a request are separate submissions and may be decoded on
different replicas. When a replica dies Ray starts another; a request that had received
tokens from it ends with a retryable 503 (an SSE error event when streamed), one that had
received none is sent once more to a live replica.

Knows nothing of models or HTTP: each replica loads the plan's Settings (assemble.py, through
run.load_served; the ingress only its tokenizer), the routes come from app.py. Ray is imported only
inside functions: the module imports without it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from .metrics import Metrics
from .scheduler import Event, QueueFull, Scheduler, Submission

APP = "verispec"
ENGINE = "VerispecEngine"
INGRESS = "VerispecIngress"
HUB_NAMESPACE = "verispec"
PUSH_EVERY_S = 0.5  # an engine replica's metrics reach the hub this often
STALE_AFTER_S = 10.0  # a replica silent this long (dead, or restarted under a new id) leaves /metrics


@dataclass(frozen=True)
class Frontend:
    """What the API says of the model (the ingress needs no weights)."""

    model_name: str
    vocab_size: int
    max_model_len: int
    eos: tuple[int, ...]
    chat_template: tuple[str, dict] | None


@dataclass(frozen=True)
class Plan:
    """Everything a replica needs, picklable: the settings it loads its models from."""

    settings: object  # an assemble.Settings: each engine replica loads its models, the ingress its tokenizer
    frontend: Frontend
    replicas: int
    threads: int  # torch and llama.cpp threads per engine replica
    max_batch: int = 8
    max_waiting: int = 64
    prefill_chunk: int = 256
    hub: str = "verispec-metrics"

    def __post_init__(self) -> None:
        for name in ("replicas", "threads", "max_batch", "max_waiting", "prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def per_replica(self) -> int:
        """Requests one replica holds at most: its rows and its waiting queue."""
        return self.max_batch + self.max_waiting

    @property
    def capacity(self) -> int:
        return self.replicas * self.per_replica


@dataclass
class ReplicaEvent(Event):
    """A scheduler's event as it crosses from an engine replica: it names the replica."""

    replica: str | None = None


# ---- the engine replicas


class EngineReplica:
    """One engine: the plan's models, a `Scheduler`, and a thread that pushes its metrics."""

    def __init__(self, plan: Plan):
        import torch
        from ray import serve

        from .run import load_served

        torch.set_num_threads(plan.threads)
        models = load_served(plan.settings, plan.frontend.model_name)
        self.replica = serve.get_replica_context().replica_tag
        self.metrics = Metrics(plan.frontend.model_name, replica=self.replica)
        self.scheduler = Scheduler(
            models.target,
            models.drafter,
            models.k,
            plan.max_batch,
            plan.max_waiting,
            plan.frontend.max_model_len,
            self.metrics,
            plan.prefill_chunk,
        )
        self.scheduler.start()
        self._stopped = threading.Event()
        threading.Thread(target=self._push_metrics, args=(plan.hub,), name="verispec-metrics-push", daemon=True).start()

    async def generate(self, prompt: list[int], params, logprobs: int | None) -> AsyncIterator[ReplicaEvent]:
        """One request's events until its end; cancelling the call (the client left, or a stop
        string was found) cancels the request."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        submission = Submission(
            prompt, params, lambda event: loop.call_soon_threadsafe(events.put_nowait, event), logprobs=logprobs
        )
        try:
            self.scheduler.submit(submission)
        except QueueFull as full:
            yield ReplicaEvent([], "error", error=f"the replica is busy: {full}; retry", replica=self.replica)
            return
        finished = False
        try:
            while not finished:
                event = await events.get()
                finished = event.finish_reason is not None
                yield ReplicaEvent(**vars(event), replica=self.replica)
        finally:
            if not finished:
                self.scheduler.cancel(submission)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine stopped is replaced."""
        if self.scheduler.error is not None:
            raise RuntimeError(f"the engine stopped: {self.scheduler.error}")

    def _push_metrics(self, hub_name: str) -> None:
        import ray

        hub = None
        while True:
            try:
                hub = hub or ray.get_actor(hub_name, namespace=HUB_NAMESPACE)
                hub.push.remote(self.replica, self.metrics.render().decode())
            except Exception:  # noqa: BLE001 (no hub yet, or it went away: try again next time)
                hub = None
            if self._stopped.wait(PUSH_EVERY_S):
                return

    def __del__(self) -> None:
        if hasattr(self, "_stopped"):
            self._stopped.set()
        if hasattr(self, "scheduler"):
            self.scheduler.stop()


# ---- the metrics hub


class MetricsHub:
    """The latest Prometheus text of each engine replica (a plain Ray actor, `ray.remote` at start)."""

    def __init__(self):
        self.texts: dict[str, tuple[float, str]] = {}

    def push(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def collect(self, max_age: float = STALE_AFTER_S) -> list[str]:
        now = time.monotonic()
        self.texts = {replica: (at, text) for replica, (at, text) in self.texts.items() if now - at <= max_age}
        return [text for _, (_, text) in sorted(self.texts.items())]


def merge_metrics(texts: list[str]) -> bytes:
    """One exposition of many registries' texts: each family once, with every text's samples
    (their labels, `replica` among them, keep the series apart)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families: dict = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name in families:
                families[family.name].samples.extend(family.samples)
            else:
                families[family.name] = family

    class Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged())
    return generate_latest(registry)


class MergedMetrics:
    """`render()` for app.py's `/metrics`: every live replica's metrics, from the hub."""

    def __init__(self, hub_name: str):
        self.hub_name = hub_name

    async def render(self) -> bytes:
        import ray

        hub = ray.get_actor(self.hub_name, namespace=HUB_NAMESPACE)
        return merge_metrics(await hub.collect.remote())


# ---- the ingress


def _replica_lost() -> tuple[type[BaseException], ...]:
    """The errors that mean the replica went away (died, its node died, or it is unreachable)."""
    from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError
    from ray.serve.exceptions import ReplicaUnavailableError

    return RayActorError, WorkerCrashedError, NodeDiedError, ReplicaUnavailableError


class RemoteScheduler:
    """What app.py uses of a `Scheduler` (`submit`, `cancel`, `error`), over the engine replicas:
    each submission is one streaming `generate` call, relayed by a task on the ingress's loop."""

    def __init__(self, capacity: int, engine: Callable[[], object] | None = None, attempts: int = 2):
        self.capacity = capacity  # submissions in flight at most (replicas x (rows + waiting)); beyond: QueueFull (503)
        self.attempts = attempts  # tries of a request that has received nothing yet
        self.error: BaseException | None = None  # never set: Ray replaces replicas that stop
        self._engine = engine or _engine_handle
        self._tasks: dict[Submission, asyncio.Task] = {}

    def submit(self, submission: Submission) -> None:
        if len(self._tasks) >= self.capacity:
            raise QueueFull(
                f"{len(self._tasks)} requests are in flight already (replicas x (--max-batch + --max-waiting) = "
                f"{self.capacity})"
            )
        self._tasks[submission] = asyncio.get_running_loop().create_task(self._relay(submission))

    def cancel(self, submission: Submission, reason: str = "abort") -> None:
        submission.cancelled = reason
        task = self._tasks.get(submission)
        if task is not None:
            task.cancel()

    async def _relay(self, submission: Submission) -> None:
        try:
            for attempt in range(1, self.attempts + 1):
                why = await self._attempt(submission, last=attempt == self.attempts)
                if why is None:
                    return
                if why:
                    submission.on_event(ReplicaEvent([], "error", error=why))
                    return
        finally:
            self._tasks.pop(submission, None)

    async def _attempt(self, submission: Submission, last: bool) -> str | None:
        """One try on one replica: None once the request ended, "" to try again (its replica
        went away before it received anything), else why it failed."""
        stream, received = None, False
        try:
            stream = (
                self._engine()
                .options(stream=True)
                .generate.remote(submission.prompt, submission.params, submission.logprobs)
            )
            async for event in stream:
                received = True
                submission.on_event(event)
                if event.finish_reason is not None:
                    return None
            return "the replica's stream ended before the request did; retry the request"
        except asyncio.CancelledError:  # the client left, or a stop string: the replica's call is cancelled too
            if stream is not None:
                stream.cancel()
            raise
        except _replica_lost() as error:
            if not received and not last:
                return ""
            return f"the replica serving this request stopped ({type(error).__name__}); retry the request"
        except Exception as error:  # noqa: BLE001 (the client must hear of any failure)
            return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def _engine_handle():
    from ray import serve

    return serve.get_deployment_handle(ENGINE, app_name=APP)


def _ingress_builder(plan: Plan) -> Callable[[], object]:
    """The function Ray Serve calls in the ingress replica to build its ASGI app."""

    def build():
        from ..assemble import load_tokenizer, to_stderr
        from .app import create_app

        front = plan.frontend
        return create_app(
            RemoteScheduler(plan.capacity),
            load_tokenizer(plan.settings, to_stderr()),
            front.model_name,
            front.vocab_size,
            front.max_model_len,
            front.eos,
            metrics=MergedMetrics(plan.hub),
            chat_template=front.chat_template,
        )

    return build


def application(plan: Plan):
    """The Ray Serve application: the ingress bound to N engine replicas."""
    from ray import serve

    engine = serve.deployment(
        EngineReplica,
        name=ENGINE,
        num_replicas=plan.replicas,
        max_ongoing_requests=plan.per_replica,
        ray_actor_options={"num_cpus": plan.threads},
        health_check_period_s=2,
        graceful_shutdown_timeout_s=5,
    )
    ingress = serve.deployment(
        serve.ingress(_ingress_builder(plan))(),
        name=INGRESS,
        num_replicas=1,
        max_ongoing_requests=plan.capacity + 64,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(engine.bind(plan))


# ---- running it


def start(plan: Plan, host: str, port: int, address: str | None = None):
    """Start a local Ray (or join `address`), the metrics hub and Serve's HTTP proxy on
    host:port, and deploy; returns the hub's handle (keep it: the hub lives as long as this
    process)."""
    import logging

    import ray
    from ray import serve

    if address is None:
        cores = max(os.cpu_count() or 1, plan.replicas * plan.threads)  # more replicas than cores: the user's choice
        ray.init(num_cpus=cores, include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=address, logging_level=logging.WARNING)
    hub = (
        ray.remote(num_cpus=0)(MetricsHub).options(name=plan.hub, namespace=HUB_NAMESPACE, get_if_exists=True).remote()
    )
    quiet = {"log_level": "WARNING", "enable_access_log": False}  # warnings and errors still reach stderr
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    serve.start(http_options={"host": host, "port": port}, logging_config=quiet)
    serve.run(application(plan), name=APP, route_prefix="/", blocking=False, logging_config=quiet)
    return hub


def stop(joined: bool = False) -> None:
    """Undeploy and leave: a local Ray is shut down whole; a joined cluster loses only this
    application (other Serve applications there go on)."""
    import ray
    from ray import serve

    if not ray.is_initialized():  # Ray never started
        return
    if joined:
        serve.delete(APP)
    else:
        serve.shutdown()
    ray.shutdown()


def serve_until_signal(
    plan: Plan, host: str, port: int, address: str | None, ready: Callable[[str, str], None]
) -> None:
    """Deploy, call `ready(url, Ray's address)`, wait for SIGINT or SIGTERM, then shut Serve and Ray down."""
    asked = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: asked.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        hub = start(plan, host, port, address)
        for sig in previous:  # again: Ray's start may have set its own
            signal.signal(sig, lambda *_: asked.set())
        import ray

        ready(f"http://{host}:{port}", ray.get_runtime_context().gcs_address)
        while not asked.wait(0.5):
            pass
        del hub
    finally:
        stop(joined=address is not None)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
