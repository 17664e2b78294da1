"""Serving: continuous batching over speculative decoding, a page pool for the KV cache, a
Python API and an OpenAI-compatible HTTP server (`python -m jaxspec.serve`).

    from jaxspec.serving import Server, Sampling
    server = Server(engine, slots=4, max_context=512)
    for piece in server.submit("Tell me a story", Sampling(max_tokens=64)):
        print(piece, end="")

`Sampling` is the one sampling type (`jaxspec.Sampling`, the same class). Every name is imported
on first use (PEP 562). Layers, one way: `requests` (what a request gets back) -> `text`
(incremental detokenisation, stop strings) -> `pages` (the page pool) -> `rows` (one row's state
spliced into the batch) -> `scheduler` (admission, device calls, release, preemption) -> `api` (a
thread running the scheduler; streams) -> `fields` (a request body read), `gate` (key, limits,
readiness, drain), `metrics` (Prometheus) -> `http` (FastAPI app).
"""

from jaxspec.exports import lazy

EXPORTS = {
    "Server": "jaxspec.serving.api",
    "Stream": "jaxspec.serving.api",
    "Sampling": "jaxspec.decode.sampling_settings",
    "Completion": "jaxspec.serving.requests",
    "QueueFull": "jaxspec.serving.requests",
    "ServingConfig": "jaxspec.config.sections",
    "register_policy": "jaxspec.serving.policy",
}

__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy(__name__, EXPORTS)
