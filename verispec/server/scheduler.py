"""The continuous batcher behind `verispec serve`: one thread owns the models and one Batch.

Owns `Scheduler`: a bounded waiting queue and `max_batch` rows. Its loop, between target
passes: requests whose client left (or whose text reached a stop string) are cancelled and
their rows freed; waiting requests join free rows (their prompts prefilled by the target in
one call; a model draft reads them before its next drafting pass, so plain passes never pay for it);
then one pass over the running rows (`engine.Batch.step`), and each request is handed
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

from ..analysis.profile import batch_sizes, calibrate
from ..config import SamplingParams
from ..engine import Batch, Staged
from ..policy import AdaptiveLength, DraftLengthPolicy, SplitLength
from ..stats import RequestStats


class QueueFull(Exception):
    """The waiting queue holds max_waiting requests: the server answers 503 at once."""


@dataclass
class Event:
    """What a request is told after a pass: new tokens, and at the end why it ended and its statistics."""

    tokens: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", or "error" (then `error` says why)
    stats: RequestStats | None = None
    error: str | None = None
    logprobs: list[tuple[float, dict[int, float]]] | None = None  # one per token, when asked for


@dataclass(eq=False)
class Submission:
    prompt: list[int]
    params: SamplingParams
    on_event: Callable[[Event], None]  # called on the scheduler's thread: must not block
    logprobs: int | None = None  # None, or alternatives wanted with each token's log-probability
    cancelled: str | None = None  # why, once cancelled: "abort" (the client left) or "stop" (a stop string)
    arrived: float = field(default_factory=time.perf_counter)
    joined_pass: int | None = None  # the scheduler's pass count when a staged prompt joined
    last_event: float | None = None


class Scheduler:
    """`submit(submission)` (QueueFull when max_waiting wait already), `cancel(submission)`,
    `start()`, `stop()`. The rows' caches hold max_model_len positions each (prompt + max_tokens).
    The batch's rows are the running submissions themselves (their ids in `engine.Batch`)."""

    def __init__(
        self,
        target,
        drafter,
        k: int | DraftLengthPolicy,
        max_batch: int,
        max_waiting: int,
        max_model_len: int,
        metrics=None,
        prefill_chunk: int = 256,
        calibrate: bool = True,
    ):
        for name, value in (
            ("max_batch", max_batch),
            ("max_waiting", max_waiting),
            ("max_model_len", max_model_len),
            ("prefill_chunk", prefill_chunk),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_batch, self.max_waiting, self.max_model_len, self.prefill_chunk = (
            max_batch,
            max_waiting,
            max_model_len,
            prefill_chunk,
        )
        self.metrics = metrics
        k_max = k.k_max if isinstance(k, DraftLengthPolicy) else k
        self.batch = Batch(
            target,
            [],
            [],
            drafter,
            k,
            capacity=max_batch,
            max_length=max_model_len + k_max + 1,
            count_requests=False,
        )
        self.waiting: deque[Submission] = deque()
        self.staging: deque[tuple[Submission, Staged]] = deque()  # long prompts being read, one piece per turn
        self.passes = 0  # target passes so far
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="verispec-scheduler", daemon=True)
        self.error: BaseException | None = None  # what stopped the loop, if anything did
        self._here = False  # `claim`ed: the loop runs on the caller's thread (run_here), not on _thread
        self._ready = threading.Event()  # set once the loop's thread has calibrated (or failed)
        self.calibrate = calibrate and isinstance(self.batch.policy, (AdaptiveLength, SplitLength))
        self.calibration_s: float | None = None  # seconds the calibration took, once done

    # ---- called from other threads

    def refusal(self, params) -> str | None:
        """Why the batch cannot run a request with these SamplingParams (None: it can)."""
        return self.batch.refusal(params)

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
        """Start the loop's thread (unless `run_here` runs the loop) and return once it is ready:
        with `--k auto` it first calibrates (passes at every batch size and k, timed before any
        request: analysis.profile.calibrate) on the loop's own thread, as every later pass.
        llama.cpp's OpenMP keeps a team of threads per calling thread; once a process holds two
        teams, libgomp counts more threads than cores and its workers sleep on a futex at every
        barrier instead of spinning: every pass pays a wake-up per layer (f32 built-in target,
        2 cores: 16 ms a token instead of 10). Loading a model runs OpenMP on its thread too (the
        kernel probe, the attention regime), so `serve` runs the loop on the thread that loaded
        the models (`run_here`) and this thread-starting path is for tests and Ray replicas."""
        if not self._here:
            self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise RuntimeError(f"the scheduler could not start: {self.error}") from self.error

    def claim(self) -> None:
        """The caller will run the loop itself (`run_here`): `start` then only waits for it."""
        self._here = True

    def run_here(self) -> None:
        """Run the loop on this thread until `stop` (after `claim`): calibration, then turns.
        An error that stops the engine is kept in `error` (requests are told), as on the thread."""
        self._run()

    def stop(self, timeout: float = 10.0) -> None:
        """Take no more requests; at its next turn the loop ends every request it holds
        (finish_reason "abort") and returns. Waits up to `timeout` s for it (0: not at all)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def running(self) -> int:
        """Requests holding a row: decoding, or having their prompt read."""
        return len(self.batch) + len(self.staging)

    # ---- the scheduler's thread

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(self.running, len(self.waiting))

    def _run(self) -> None:
        try:
            with torch.no_grad():
                if self.calibrate and self.calibration_s is None:
                    self.calibration_s = calibrate(
                        self.batch, self.batch.policy, batch_sizes(self.max_batch), self.max_model_len
                    )
                self._ready.set()
                while self._turn():
                    pass
        except BaseException as error:  # noqa: BLE001 (every request still held must hear of it)
            self.error = error
            self._ready.set()
            for submission in self._held():
                submission.on_event(Event([], "error", error=f"the engine stopped: {error}"))
            self.waiting, self.staging = deque(), deque()
            self._gauges()

    def _turn(self) -> bool:
        with self._wake:
            while not self._stopping and not self.waiting and self.running == 0:
                self._wake.wait(0.5)
            if self._stopping:
                for submission in self._held():
                    submission.on_event(Event([], "abort", error="the server is shutting down"))
                return False
            joining: list[Submission] = []
            while len(joining) < self.max_batch - self.running and self.waiting:
                submission = self.waiting.popleft()
                if submission.cancelled:
                    submission.on_event(Event([], submission.cancelled))
                    continue
                staged = self.batch.reserve() if len(submission.prompt) - 1 > self.prefill_chunk else None
                if staged is not None:  # a long prompt: read one piece per turn, the running rows go on between
                    self.staging.append((submission, staged))
                else:
                    joining.append(submission)
        self._cancel()
        if joining:
            self._join(joining)
        if self.staging:
            self._feed()
        self._gauges()
        if len(self.batch):
            self._pass()
            self._gauges()
        return True

    def _held(self) -> list[Submission]:
        return list(self.batch.ids) + [s for s, _ in self.staging] + list(self.waiting)

    def _feed(self) -> None:
        """One piece of the oldest staged prompt; once all but its last token is read, it joins."""
        submission, staged = self.staging[0]
        body = submission.prompt[:-1]
        self.batch.feed(staged, body[staged.fed : staged.fed + self.prefill_chunk])
        if self.metrics is not None:
            self.metrics.prefill_chunks.inc()
        if staged.fed < len(body):
            return
        self.staging.popleft()
        try:
            self.batch.join_staged(staged, submission.prompt, submission.params, submission, submission.logprobs)
        except ValueError as error:
            self.batch.release(staged)
            submission.on_event(Event([], "error", error=str(error)))
            return
        submission.joined_pass = self.passes

    def _cancel(self) -> None:
        for submission, staged in list(self.staging):
            if submission.cancelled:
                self.staging.remove((submission, staged))
                self.batch.release(staged)
                self._finish(
                    submission,
                    Event([], submission.cancelled, stats=RequestStats(prompt_tokens=len(submission.prompt))),
                )
        for reason in ("abort", "stop"):
            cancelled = [s for s in self.batch.ids if s.cancelled == reason]
            if cancelled:
                self.batch.cancel(cancelled, reason)
                for submission, request in self.batch.finished:
                    self._finish(submission, Event([], reason, stats=request))

    def _join(self, joining: list[Submission]) -> None:
        try:
            self.batch.join(
                [s.prompt for s in joining], [s.params for s in joining], joining, [s.logprobs for s in joining]
            )
        except ValueError as error:  # the HTTP layer checks first: this is a last line, never a crash
            for submission in joining:
                submission.on_event(Event([], "error", error=str(error)))

    def _pass(self) -> None:
        chunk = self.batch.step()
        self.passes += 1
        now = time.perf_counter()
        if self.metrics is not None:
            self.metrics.observe_pass(len(chunk), self.batch.last_k, list(self.batch.last_accepted.values()))
        finished = dict(self.batch.finished)
        for submission, tokens in chunk.items():
            if self.metrics is not None and tokens:
                if submission.last_event is None:
                    self.metrics.observe_first_token(now - submission.arrived)
                else:
                    self.metrics.observe_inter_token(now - submission.last_event, len(tokens))
            if tokens:
                submission.last_event = now
            logprobs = self.batch.last_logprobs.get(submission)
            if submission in finished:
                request = finished[submission]
                self._finish(submission, Event(tokens, request.finish_reason, stats=request, logprobs=logprobs))
            elif tokens:
                submission.on_event(Event(tokens, logprobs=logprobs))

    def _finish(self, submission: Submission, event: Event) -> None:
        if self.metrics is not None and event.stats is not None:
            self.metrics.observe_finished(event.finish_reason or "abort", event.stats)
        submission.on_event(event)
