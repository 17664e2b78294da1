"""Serving: continuous batching over speculative decoding, a page pool for the KV cache, a
Python API and an OpenAI-compatible HTTP server (`python -m jaxspec.serve`).

    from jaxspec.serving import Server, Sampling
    server = Server(engine, slots=4, max_context=512)
    for piece in server.submit("Tell me a story", Sampling(max_tokens=64)):
        print(piece, end="")

Layers, one way: `requests` (what a request asks and what it gets back) -> `text` (incremental
detokenisation, stop strings) -> `pages` (the page pool) -> `rows` (one row's state spliced into
the batch) -> `scheduler` (admission, device calls, release, preemption) -> `api` (a thread
running the scheduler; streams) -> `fields` (a request body read), `gate` (key, limits,
readiness, drain), `metrics` (Prometheus) -> `http` (FastAPI app).
"""

from jaxspec.serving.api import Server, Stream
from jaxspec.serving.requests import Completion, QueueFull, Sampling

__all__ = ["Completion", "QueueFull", "Sampling", "Server", "Stream"]
