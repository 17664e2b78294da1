"""What the server tests share: the tiny byte-tokenizer chat model they serve, and uvicorn on a
loopback socket bound before it starts (port 0: the port is known, no free-port race)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

NAME = "tiny-bytes"
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def byte_chat_model(directory: Path, template: str = CHAT_TEMPLATE):
    """The tiny random target (vocab 256, packed layout) with a byte tokenizer and `template`."""
    from conftest import save_byte_tokenizer
    from tiny import tiny_model
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(save_byte_tokenizer(directory))
    tok.chat_template = template
    return dataclasses.replace(tiny_model(vocab=256, packed=True), tokenizer=tok, name=NAME)


@contextlib.contextmanager
def listening(app, start_within_s: float = 60) -> Iterator[str]:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a thread; yields its base URL."""
    import socket

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    http = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + start_within_s
    while not http.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    assert http.started, f"the server did not start within {start_within_s:.0f} s"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        http.should_exit = True
        thread.join(timeout=60)


def speculative_byte_engine(directory: Path, context: int):
    """The byte chat model under n-gram speculation (γ 3), recording 5 top logprobs: the engine
    the server-field tests share."""
    from jaxspec.drafters.prompt_lookup import NgramDrafter
    from jaxspec.engine.runner import Engine

    return Engine(byte_chat_model(directory), NgramDrafter(256, 1, 3), num_speculative_tokens=3,
                  max_context=context, logprobs=5)


@contextlib.contextmanager
def serving(engine, context: int) -> Iterator[str]:
    """`engine` behind a `Server` (4 slots, 4 steps per call) on loopback; yields the base URL."""
    from jaxspec.serving import Server
    from jaxspec.serving.http import make_app

    server = Server(engine, slots=4, max_context=context, steps_per_call=4, max_queue=16,
                    model_name=NAME)
    try:
        with listening(make_app(server)) as url:
            yield url
    finally:
        server.close()


def openai_client(url: str):
    """The real `openai` client on `url`, no retries (a failure shows), generous timeout."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
