"""Putting the server together and running it: `build` (scheduler, metrics, app over loaded
models) and `run` (uvicorn on host:port until SIGINT or SIGTERM, then the scheduler stops:
the requests it held end with an error event, the thread is joined).
"""

from __future__ import annotations

import contextlib

from .app import create_app
from .metrics import Metrics
from .scheduler import Scheduler


def build(target, drafter, tokenizer, *, model_name: str, k, max_batch: int = 8, max_waiting: int = 64,
          max_model_len: int | None = None, eos: tuple[int, ...] = ()):
    """(app, scheduler) over loaded models; the scheduler's thread starts with the app (lifespan)."""
    context = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    if max_model_len is None:
        max_model_len = context if isinstance(context, int) else 2048
    if isinstance(context, int) and max_model_len > context:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's context of {context} positions")
    metrics = Metrics(model_name)
    scheduler = Scheduler(target, drafter, k, max_batch, max_waiting, max_model_len, metrics)
    app = create_app(scheduler, tokenizer, model_name, target.vocab_size, max_model_len, eos, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app.router.lifespan_context = lifespan
    return app, scheduler


def run(app, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn's own handling), then shut the scheduler down."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
