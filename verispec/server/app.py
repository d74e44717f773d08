"""The HTTP routes of `verispec serve` (FastAPI), over a running `Scheduler`.

Owns `create_app`: `POST /v1/completions` (non-streaming and server-sent events ending with
`data: [DONE]`), `POST /v1/chat/completions` (messages rendered by the model's chat template,
chat.py; a clear 400 when it has none),
`GET /v1/models`, `GET /health`, `GET /metrics`. A request is checked whole before any work
(protocol.py); each of its n choices per prompt is one `Submission`; stop strings are found in
the decoded text, which is cut there, and the row is cancelled at once. A client that goes
away cancels its requests: their rows are free by the next pass. Every refusal is a 4xx (or
503 when the queue is full) with OpenAI's error body; nothing a client sends reaches the
engine unchecked. A 503 (busy, or a request that could not be completed) is retryable: its
body's `code` is 503, and a stream that fails sends such a body as its last event; a stream
the server's shutdown ends gets its last chunk (finish_reason "abort") and [DONE]. The
scheduler may be a local `Scheduler` or anything with its `submit`, `cancel` and `error`
(replicas.py's, over Ray Serve replicas, whose events also name the replica).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..models.token_text import prompt_bos
from .chat import check_messages, render, without_added_bos
from .metrics import CONTENT_TYPE, Metrics
from .protocol import (
    BadRequest,
    CompletionRequest,
    check_text,
    error_body,
    find_stop,
    parse_completion,
    safe_prefix,
)
from .scheduler import Event, QueueFull, Scheduler, Submission

MAX_BODY = 1 << 20  # bytes
CHAT_FIELDS = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "sampling",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
}


@dataclass
class _Choice:
    index: int
    submission: Submission | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # (log p, {alternative: log p}) per token, when asked for
    logprobs_sent: int = 0  # tokens whose logprobs were streamed
    kept: int | None = None  # tokens counted once a stop string cut the text
    text: str = ""
    sent: int = 0  # characters already streamed
    finish_reason: str | None = None
    error: str | None = None
    stats: object = None
    replica: str | None = None  # the Ray Serve replica that decoded it (replicas.py), when there is one

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def _stats(choice: _Choice) -> dict:
    s = choice.stats
    where = {} if choice.replica is None else {"replica": choice.replica}
    if s is None:
        return {"index": choice.index, **where}
    return {
        "index": choice.index,
        **where,
        "generated_tokens": len(choice.tokens) if choice.kept is None else choice.kept,
        "target_passes": s.target_passes,
        "proposed": s.proposed,
        "accepted": s.accepted,
        "alpha_hat": s.accepted / s.proposed if s.proposed else None,
        "tokens_per_pass": s.generated_tokens / s.target_passes if s.target_passes else None,
    }


def create_app(
    scheduler: Scheduler,
    tokenizer,
    model_name: str,
    vocab_size: int,
    max_model_len: int,
    eos: tuple[int, ...],
    metrics: Metrics | None = None,
    max_body: int = MAX_BODY,
    chat_template: tuple[str, dict] | None = None,
) -> FastAPI:
    app = FastAPI(title="verispec", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text).ids

    bos = prompt_bos(tokenizer)

    def refuse(
        message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"
    ) -> JSONResponse:
        if status == 503:  # retryable: the code says so, and when
            return JSONResponse(error_body(message, param, kind, 503), status_code=503, headers={"Retry-After": "1"})
        return JSONResponse(error_body(message, param, kind), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return refuse(
            str(exc.detail),
            None,
            exc.status_code,
            "not_found_error" if exc.status_code == 404 else "invalid_request_error",
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return refuse(f"internal error: {type(exc).__name__}: {exc}", None, 500, "server_error")

    async def read_json(request: Request):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body):
            raise BadRequest(f"the request body is larger than {max_body} bytes", None, 413)
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > max_body:
                raise BadRequest(f"the request body is larger than {max_body} bytes", None, 413)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise BadRequest(f"the request body is not valid UTF-8 ({error.reason} at byte {error.start})") from None
        try:
            body = json.loads(text)
        except json.JSONDecodeError as error:
            raise BadRequest(
                f"the request body is not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})"
            ) from None
        check_text(body)  # before any field is read: a lone surrogate is named, never a 500 from the tokenizer
        return body

    def apply(choice: _Choice, event: Event, stop: list[str]) -> None:
        """A choice's new tokens and its end: the text is decoded again, cut at a stop string."""
        if choice.done:
            return
        before = len(choice.tokens)
        choice.tokens.extend(event.tokens)
        if event.logprobs is not None:
            choice.logprobs.extend(event.logprobs)
        choice.stats = event.stats or choice.stats
        choice.replica = getattr(event, "replica", None) or choice.replica
        text = decode(choice.tokens)
        at = find_stop(text, stop) if stop else None
        if at is not None:  # the fewest tokens whose text holds the stop string are the ones counted
            choice.kept = next(
                m
                for m in range(before + 1, len(choice.tokens) + 1)
                if find_stop(decode(choice.tokens[:m]), stop) is not None
            )
            choice.text, choice.finish_reason = text[:at], "stop"
            if event.finish_reason is None:
                scheduler.cancel(choice.submission, "stop")
            return
        choice.text = text
        if event.finish_reason is not None:
            choice.finish_reason, choice.error = event.finish_reason, event.error

    def logprobs_of(choice: _Choice, start: int, end: int | None, offset: int = 0) -> dict:
        """OpenAI's logprobs object for the choice's tokens start..end (text offsets from `offset`)."""
        count = len(choice.tokens) if choice.kept is None else choice.kept
        end = count if end is None else min(end, count)
        tokens = [decode([t]) for t in choice.tokens[start:end]]
        offsets, at = [], offset
        for text in tokens:
            offsets.append(at)
            at += len(text)
        pairs = choice.logprobs[start:end]
        top = [{decode([t]): lp for t, lp in alternatives.items()} for _, alternatives in pairs]
        return {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _ in pairs],
            "top_logprobs": top if any(top) else None,
            "text_offset": offsets,
        }

    def usage(request: CompletionRequest, choices: list[_Choice]) -> dict:
        prompt_tokens = sum(len(p) for p in request.prompts)
        completion = sum(len(c.tokens) if c.kept is None else c.kept for c in choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def submit(request: CompletionRequest, queue: asyncio.Queue) -> list[_Choice]:
        loop = asyncio.get_running_loop()
        choices = [_Choice(i) for i in range(len(request.params))]
        for choice, prompt, params in zip(
            choices, [p for p in request.prompts for _ in range(request.n)], request.params
        ):

            def on_event(event: Event, index: int = choice.index) -> None:  # the scheduler's thread
                loop.call_soon_threadsafe(queue.put_nowait, (index, event))

            choice.submission = Submission(prompt, params, on_event, logprobs=request.logprobs)
        submitted = []
        try:
            for choice in choices:
                scheduler.submit(choice.submission)
                submitted.append(choice)
        except QueueFull:
            for choice in submitted:
                scheduler.cancel(choice.submission)
            raise
        return choices

    def cancel_all(choices: list[_Choice]) -> None:
        for choice in choices:
            if not choice.done and choice.submission is not None:
                scheduler.cancel(choice.submission)

    @app.post("/v1/completions")
    async def completions(http: Request):
        try:
            body = await read_json(http)
            request = parse_completion(
                body, model_name=model_name, encode=encode, vocab_size=vocab_size, max_model_len=max_model_len, eos=eos
            )
        except BadRequest as bad:
            return refuse(bad.message, bad.param, bad.status, bad.kind)
        return await respond(http, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        try:
            body = await read_json(http)
            if chat_template is None:
                raise BadRequest(
                    f"the model '{model_name}' has no chat template in its tokenizer: use /v1/completions with a "
                    "prompt",
                    "messages",
                )
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            unknown = sorted(set(body) - CHAT_FIELDS)
            if unknown:
                raise BadRequest(f"unrecognized request argument '{unknown[0]}'", unknown[0])
            if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
                raise BadRequest("'logprobs' is not supported for chat yet: use /v1/completions", "logprobs")
            messages = check_messages(body.get("messages"))
            completion = {
                key: value
                for key, value in body.items()
                if key not in ("messages", "max_completion_tokens", "logprobs", "top_logprobs")
            }
            if body.get("max_completion_tokens") is not None:
                completion["max_tokens"] = body["max_completion_tokens"]
            rendered = render(chat_template[0], chat_template[1], messages)
            completion["prompt"] = without_added_bos(rendered, chat_template[1], bos)
            request = parse_completion(
                completion,
                model_name=model_name,
                encode=encode,
                vocab_size=vocab_size,
                max_model_len=max_model_len,
                eos=eos,
            )
        except BadRequest as bad:
            return refuse(bad.message, bad.param, bad.status, bad.kind)
        return await respond(http, request, chat=True)

    async def respond(http: Request, request: CompletionRequest, chat: bool):
        queue: asyncio.Queue = asyncio.Queue()
        refusal = getattr(scheduler, "refusal", None)  # settings the running step cannot take
        for why in filter(None, map(refusal, request.params) if refusal is not None else []):
            return refuse(why, "sampling")
        try:
            choices = submit(request, queue)
        except QueueFull as full:
            return refuse(f"the server is busy: {full}; try again later", None, 503, "server_error")
        identity = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if request.stream:
            return StreamingResponse(stream(request, choices, queue, identity, chat), media_type="text/event-stream")
        try:
            while not all(c.done for c in choices):
                try:
                    index, event = await asyncio.wait_for(queue.get(), timeout=1.0)
                except TimeoutError:
                    if await http.is_disconnected():
                        cancel_all(choices)
                        return Response(status_code=499)
                    continue
                apply(choices[index], event, request.stop)
        except asyncio.CancelledError:
            cancel_all(choices)
            raise
        failed = [c for c in choices if c.finish_reason in ("error", "abort")]
        if failed:
            return refuse(
                f"the request could not be completed: {failed[0].error or 'the server is shutting down'}",
                None,
                503,
                "server_error",
            )
        if chat:
            listed = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ]
        else:
            listed = [
                {
                    "index": c.index,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "logprobs": None if request.logprobs is None else logprobs_of(c, 0, None),
                }
                for c in choices
            ]
        return {
            "id": identity,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": listed,
            "usage": usage(request, choices),
            "verispec": {"choices": [_stats(c) for c in choices]},
        }

    async def stream(
        request: CompletionRequest, choices: list[_Choice], queue: asyncio.Queue, identity: str, chat: bool
    ):
        def chunk(choice_list: list[dict], **extra) -> str:
            payload = {
                "id": identity,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": choice_list,
                **extra,
            }
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        try:
            if chat:  # the role first, as OpenAI's streams do
                yield chunk(
                    [
                        {
                            "index": c.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for c in choices
                    ]
                )
            while not all(c.done for c in choices):
                index, event = await queue.get()
                choice = choices[index]
                apply(choice, event, request.stop)
                if choice.finish_reason == "error":  # "abort" (the server stops) ends the choice below, as any finish
                    message = f"the request could not be completed: {choice.error or choice.finish_reason}"
                    yield f"data: {json.dumps(error_body(message, None, 'server_error', 503))}\n\n"
                    cancel_all(choices)
                    return
                end = safe_prefix(choice.text, request.stop, choice.done)
                if end > choice.sent or choice.done:
                    logprobs = None
                    if request.logprobs is not None:  # the tokens committed since the last chunk
                        logprobs = logprobs_of(choice, choice.logprobs_sent, None, choice.sent)
                        choice.logprobs_sent = len(choice.tokens) if choice.kept is None else choice.kept
                    piece, choice.sent = choice.text[choice.sent : end], max(end, choice.sent)
                    if chat:
                        yield chunk(
                            [
                                {
                                    "index": index,
                                    "delta": {"content": piece} if piece else {},
                                    "logprobs": None,
                                    "finish_reason": choice.finish_reason,
                                }
                            ]
                        )
                    else:
                        yield chunk(
                            [
                                {
                                    "index": index,
                                    "text": piece,
                                    "logprobs": logprobs,
                                    "finish_reason": choice.finish_reason,
                                }
                            ]
                        )
            if request.include_usage:
                yield chunk([], usage=usage(request, choices), verispec={"choices": [_stats(c) for c in choices]})
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the task is cancelled) or the stream ended: free the rows
            cancel_all(choices)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "verispec",
                    "max_model_len": max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health():
        if scheduler.error is not None:
            return refuse(f"the engine stopped: {scheduler.error}", None, 503, "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            return Response(b"", media_type=CONTENT_TYPE)
        body = metrics.render()
        if inspect.isawaitable(body):  # replicas.py's merge of every replica's metrics
            body = await body
        return Response(body, media_type=CONTENT_TYPE)

    return app
