"""The OpenAI-compatible server (python -m jaxspec.serve's app) over loopback with the real
`openai` client: completions and chat, streamed and not, equal to solo Engine runs; concurrent
clients; a client that disconnects mid-stream frees its row and pages; bad JSON, bad fields,
an unknown model and a full queue get 400 / 404 / 429 with one-line messages; a bounded load
test (fixed clients, fixed duration) checks every response."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from loopback import NAME, byte_chat_model, listening, openai_client  # noqa: E402
from jaxspec.drafters.ngram import NgramDrafter  # noqa: E402
from jaxspec.engine.runner import Engine  # noqa: E402
from jaxspec.serving import QueueFull, Sampling, Server  # noqa: E402
from jaxspec.serving.http import make_app  # noqa: E402

CONTEXT = 128
PROMPTS = ["abcabcabc", "hello there", "xyz", "the cat sat on the mat"]
NEW = 12


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = byte_chat_model(tmp_path_factory.mktemp("bytes"))
    return Engine(model, NgramDrafter(256, 1, 3), num_speculative_tokens=3, max_context=CONTEXT)


@pytest.fixture(scope="module")
def solo(engine):
    """Greedy text of each prompt, one Engine run each (no chat template: completions)."""
    tok = engine.model.tokenizer
    return {p: engine.decode_text(engine.generate([tok.encode(p)], max_new_tokens=NEW)[0].token_ids)
            for p in PROMPTS}


@pytest.fixture(scope="module")
def served(engine):
    server = Server(engine, slots=3, max_context=CONTEXT, steps_per_call=4, max_queue=3,
                    model_name=NAME)
    with listening(make_app(server)) as url:
        yield server, url
    server.close()


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served[1])


def complete(client, prompt, **kw):
    return client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0, **kw)


def idle(server, timeout=60):
    """Wait until no request is in flight; the health report then."""
    end = time.time() + timeout
    while time.time() < end:
        h = server.health()
        if h["active"] == 0 and h["queued"] == 0:
            return h
        time.sleep(0.05)
    raise AssertionError(f"still busy: {server.health()}")


def test_completions_equal_solo_runs_streamed_or_not(client, solo):
    out = complete(client, PROMPTS[0])
    assert out.choices[0].text == solo[PROMPTS[0]]
    assert out.usage.completion_tokens == NEW and out.usage.prompt_tokens == len(PROMPTS[0])
    assert out.usage.model_extra["speculative"]["method"] == "ngram"
    pieces, last = [], None
    for chunk in complete(client, PROMPTS[1], stream=True):
        pieces.append(chunk.choices[0].text)
        last = chunk
    assert "".join(pieces) == solo[PROMPTS[1]]
    assert last.choices[0].finish_reason == "length" and last.usage.completion_tokens == NEW


def test_chat_completions_apply_the_chat_template(client, engine):
    messages = [{"role": "user", "content": "hi"}]
    ids = engine.model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
    want = engine.decode_text(engine.generate([list(ids)], max_new_tokens=NEW)[0].token_ids)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW,
                                         temperature=0)
    assert out.choices[0].message.content == want and out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want


def test_concurrent_clients_each_get_their_own_output(client, solo):
    results = {}

    def ask(p):
        results[p] = complete(client, p).choices[0].text

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == solo


def test_a_client_that_disconnects_frees_its_row_and_pages(served):
    server, url = served
    body = {"model": NAME, "prompt": "abc", "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first piece arrived: the row is running
    h = idle(server)
    assert h["free_pages"] == h["kv_pages"]


@pytest.mark.parametrize("body,status,word", [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"model": "gpt-9", "prompt": "a"}).encode(), 404, "gpt-9"),
    (json.dumps({"prompt": "a", "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "a", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"prompt": "a" * 200, "max_tokens": 4}).encode(), 400, "max_context"),
    (json.dumps({"messages": []}).encode(), 400, "messages"),
])
def test_bad_requests_get_a_one_line_error(served, body, status, word):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = httpx.post(served[1] + path, content=body, timeout=60)
    assert r.status_code == status
    message = r.json()["error"]["message"]
    assert word in message and "\n" not in message


def test_unknown_model_through_the_client(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a", max_tokens=2)


def test_models_and_health(served):
    _, url = served
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [NAME]
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_a_full_queue_gets_429(served):
    server, url = served
    idle(server)
    long, held = Sampling(max_tokens=110), []
    try:
        held += [server.submit([97, 98, 99], long) for _ in range(3)]
        while server.health()["active"] < 3:  # 3 rows running (110 tokens each)
            time.sleep(0.01)
        with pytest.raises(QueueFull):  # then 3 queued, then refused
            for _ in range(4):
                held.append(server.submit([97, 98, 99], long))
        assert len(held) == 3 + 3
        r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
        assert r.status_code == 429 and "queue" in r.json()["error"]["message"]
    finally:
        for s in held:
            s.cancel()
    idle(server)


def test_bounded_load_every_response_checked(served, client, solo):
    """8 clients for 6 seconds over loopback, every response compared with its solo run."""
    server, _ = served
    end, failures, count, lock = time.time() + 6.0, [], [0], threading.Lock()

    def worker(seed):
        rng = random.Random(seed)
        while time.time() < end:
            p = rng.choice(PROMPTS)
            try:
                text = complete(client, p).choices[0].text
            except openai.RateLimitError:  # the queue was full: a valid answer under load
                continue
            with lock:
                count[0] += 1
                if text != solo[p]:
                    failures.append((p, text))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and count[0] >= 4
    h = idle(server)
    assert h["free_pages"] == h["kv_pages"]


# ---- python -m jaxspec.serve as a command --------------------------------------------------
def _serve_cmd(*args):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "jaxspec.serve", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("args, word", [
    (["-o", "serving.slots=0"], "serving.slots"),
    (["--config", "configs/no-such.yaml"], "no-such.yaml"),
    (["--port", "70000"], "--port 70000"),
])
def test_the_serve_command_refuses_bad_settings_in_one_line(args, word):
    proc = _serve_cmd(*args)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert err.count("\n") == 1 and err.startswith("error:") and word in err
    assert "Traceback" not in err


def test_the_serve_command_answers_health_on_loopback():
    """--port 0: the server binds any free port and prints the URL once it accepts connections."""
    proc = _serve_cmd("--config", "configs/smollm2-135m.yaml", "-o", "serving.slots=1",
                      "-o", "serving.max_context=128", "--port", "0")
    try:
        url, lines = None, []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        deadline = time.time() + 600
        while url is None and time.time() < deadline and proc.poll() is None:
            url = next((ln.split("listening on ", 1)[1].strip() for ln in list(lines)
                        if "listening on http://" in ln), None)
            time.sleep(0.2)
        assert url is not None, "".join(lines)[-3000:]
        health = httpx.get(f"{url}/health", timeout=5).json()
        assert health["status"] == "ok" and health["slots"] == 1
        assert health["kv_pages"] == 128 // 16
        models = httpx.get(f"{url}/v1/models", timeout=5).json()
        assert [m["id"] for m in models["data"]] == ["smollm2-135m"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
