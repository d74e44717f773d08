"""The continuous batcher behind `verispec serve`: one thread owns the models and one Batch.

Owns `Scheduler`: a bounded waiting queue and `max_batch` rows. Its loop, between target
passes: requests whose client left (or whose text reached a stop string) are cancelled and
their rows freed; waiting requests join free rows (their prompts prefilled in one call per
model); then one pass over the running rows (`engine.Batch.step`), and each request is handed
its new tokens through its own callback. `Submission` is one request as the scheduler sees it.
Knows nothing of HTTP or text; the metrics are told what happened (metrics.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import SamplingParams
from ..control import DraftLengthPolicy
from ..engine import Batch
from ..stats import RequestStats

PLACEHOLDER = SamplingParams(temperature=0, max_new_tokens=1)  # a free row's settings (it never runs)


class QueueFull(Exception):
    """The waiting queue holds max_waiting requests: the server answers 503 at once."""


@dataclass
class Event:
    """What a request is told after a pass: new tokens, and at the end why it ended and its statistics."""

    tokens: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", or "error" (then `error` says why)
    stats: RequestStats | None = None
    error: str | None = None


@dataclass(eq=False)
class Submission:
    prompt: list[int]
    params: SamplingParams
    on_event: Callable[[Event], None]  # called on the scheduler's thread: must not block
    cancelled: str | None = None  # why, once cancelled: "abort" (the client left) or "stop" (a stop string)
    arrived: float = field(default_factory=time.perf_counter)
    last_event: float | None = None


class Scheduler:
    """`submit(submission)` (QueueFull when max_waiting wait already), `cancel(submission)`,
    `start()`, `stop()`. The rows' caches hold max_model_len positions each (prompt + max_tokens)."""

    def __init__(self, target, drafter, k: int | DraftLengthPolicy, max_batch: int, max_waiting: int, max_model_len: int, metrics=None):
        for name, value in (("max_batch", max_batch), ("max_waiting", max_waiting), ("max_model_len", max_model_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_batch, self.max_waiting, self.max_model_len = max_batch, max_waiting, max_model_len
        self.metrics = metrics
        k_max = k.k_max if isinstance(k, DraftLengthPolicy) else k
        self.batch = Batch(target, [[0]] * max_batch, PLACEHOLDER, drafter, k, live=[False] * max_batch,
                           compiled=False, max_length=max_model_len + k_max + 1)
        self.rows: list[Submission | None] = [None] * max_batch
        self.waiting: deque[Submission] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="verispec-scheduler", daemon=True)
        self.error: BaseException | None = None  # what stopped the loop, if anything did

    # ---- called from other threads

    def submit(self, submission: Submission) -> None:
        with self._wake:
            if self._stopping or self.error is not None:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already (--max-waiting {self.max_waiting})")
            self.waiting.append(submission)
            self._gauges()
            self._wake.notify()

    def cancel(self, submission: Submission, reason: str = "abort") -> None:
        submission.cancelled = reason
        with self._wake:
            self._wake.notify()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def running(self) -> int:
        return sum(1 for s in self.rows if s is not None)

    # ---- the scheduler's thread

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(self.running, len(self.waiting))

    def _run(self) -> None:
        try:
            with torch.no_grad():
                while self._turn():
                    pass
        except BaseException as error:  # noqa: BLE001 (every request still held must hear of it)
            self.error = error
            for submission in [s for s in self.rows if s is not None] + list(self.waiting):
                submission.on_event(Event([], "error", error=f"the engine stopped: {error}"))
            self.rows, self.waiting = [None] * self.max_batch, deque()
            self._gauges()

    def _turn(self) -> bool:
        with self._wake:
            while not self._stopping and not self.waiting and self.running == 0:
                self._wake.wait(0.5)
            if self._stopping:
                for submission in [s for s in self.rows if s is not None] + list(self.waiting):
                    submission.on_event(Event([], "abort", error="the server is shutting down"))
                return False
            free = [row for row, s in enumerate(self.rows) if s is None]
            joining: list[tuple[int, Submission]] = []
            while free and self.waiting:
                submission = self.waiting.popleft()
                if submission.cancelled:
                    submission.on_event(Event([], submission.cancelled))
                    continue
                joining.append((free.pop(0), submission))
        self._cancel_rows()
        if joining:
            self._join(joining)
        self._gauges()
        if any(self.batch.active):
            self._pass()
            self._gauges()
        return True

    def _cancel_rows(self) -> None:
        for row, submission in enumerate(self.rows):
            if submission is not None and submission.cancelled:
                self.batch.cancel([row], submission.cancelled)
                self._finish(row, Event([], submission.cancelled, stats=self.batch.requests[row]))

    def _join(self, joining: list[tuple[int, Submission]]) -> None:
        rows = [row for row, _ in joining]
        submissions = [s for _, s in joining]
        try:
            self.batch.join(rows, [s.prompt for s in submissions], [s.params for s in submissions])
        except ValueError as error:  # the HTTP layer checks first: this is a last line, never a crash
            for submission in submissions:
                submission.on_event(Event([], "error", error=str(error)))
            return
        for row, submission in joining:
            self.rows[row] = submission

    def _pass(self) -> None:
        running = [row for row, live in enumerate(self.batch.active) if live]
        chunk = self.batch.step()
        now = time.perf_counter()
        k, accepted = self.batch.last_k, self.batch.last_accepted
        if self.metrics is not None:
            self.metrics.observe_pass(len(running), k, [accepted[row] for row in running])
        for row in running:
            submission = self.rows[row]
            if submission is None:
                continue
            tokens = chunk[row]
            if self.metrics is not None and tokens:
                if submission.last_event is None:
                    self.metrics.observe_first_token(now - submission.arrived)
                else:
                    self.metrics.observe_inter_token(now - submission.last_event, len(tokens))
            if tokens:
                submission.last_event = now
            if not self.batch.active[row]:
                request = self.batch.requests[row]
                self._finish(row, Event(tokens, request.finish_reason, stats=request))
            elif tokens:
                submission.on_event(Event(tokens))

    def _finish(self, row: int, event: Event) -> None:
        submission = self.rows[row]
        self.rows[row] = None
        if self.metrics is not None and event.stats is not None:
            self.metrics.observe_finished(event.finish_reason or "abort", event.stats)
        if submission is not None:
            submission.on_event(event)
