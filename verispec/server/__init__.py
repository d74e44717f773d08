"""`verispec serve`: an OpenAI-compatible HTTP server over a continuous batcher.

scheduler.py (the batcher's thread, no HTTP), metrics.py (Prometheus), protocol.py (requests
checked field by field, responses in OpenAI's shapes), app.py (the FastAPI routes). Needs the
`serve` extra: `pip install "verispec[serve]"`.
"""
