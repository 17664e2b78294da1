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
import jax.numpy as jnp
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from loopback import NAME, byte_chat_model, listening, openai_client  # noqa: E402
from jaxspec.drafters.prompt_lookup import NgramDrafter  # noqa: E402
from jaxspec.engine.runner import Engine  # noqa: E402
from jaxspec.serving import QueueFull, Sampling, Server  # noqa: E402
from jaxspec.serving.requests import RequestFailed  # noqa: E402
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
                    model_name=NAME, tables="one")  # one page-table width, as jaxspec.serve
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
        if h["active"] == 0 and h["queued"] == 0 and h["in_flight"] == 0:
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


# ---- attacks: hostile bodies, a fuzzed schema, faults (issue 57) ---------------------------
def post_raw(url, path, content, **kw):
    return httpx.post(url + path, content=content, timeout=120, **kw)


def one_line(r, status, word=""):
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert "\n" not in message and word in message, message
    return r


@pytest.mark.parametrize("body, word", [
    (b"[" * 100_000 + b"]" * 100_000, "nests"),
    (b'{"prompt": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}", "nests"),
    (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "surrogate"),
    (b'{"prompt": "a", "temperature": NaN}', "NaN"),
    (b'{"prompt": "a", "temperature": 1e999}', "finite"),
    (b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", "JSON"),
    (b'{"prompt": [-1, 5], "max_tokens": 2}', "-1"),
    (b'{"prompt": [97, 256], "max_tokens": 2}', "256"),
    (b'{"prompt": "a", "stop_token_ids": [-1]}', "stop_token_ids"),
    (b'{"prompt": "a", "repetition_penalty": 1e-300}', "repetition_penalty"),
    (b'{"prompt": "a", "temperature": 1e300}', "temperature"),
    (b'{"prompt": "a", "top_p": 1e-300}', "top_p"),
    (b'{"prompt": "a", "logit_bias": {"-1": 5}}', "logit_bias"),
    (b'{"prompt": "a", "logit_bias": {"3": 1e300}}', "logit_bias"),
    (b'{"prompt": "a", "stream": true, "stream_options": {"include_usage": "x"}}', "stream_options"),
    (b'"a string"', "JSON object"),
])
def test_hostile_bodies_get_a_one_line_400(served, body, word):
    one_line(post_raw(served[1], "/v1/completions", body), 400, word)


def test_a_chunked_upload_is_refused_once_past_the_limit(served):
    """1 MiB + 4 KiB sent chunked, the body never ended: the 413 comes anyway (counted as it
    arrives, not read whole)."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(served[1])
    with socket.create_connection((u.hostname, u.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"x" * 65536
        for _ in range(17):  # one chunk past the limit; the terminating chunk is never sent
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]


def test_a_body_that_never_arrives_whole_gets_408_in_time(served):
    """Content-Length 100, 9 bytes sent, the rest never: a 408 once the body's time limit (1 s
    here) passes, not a connection held open for ever (seen without the limit: no answer in
    45 s)."""
    import socket
    from urllib.parse import urlparse

    from jaxspec.serving.gate import Gate, Limits

    with listening(make_app(served[0], Gate(limits=Limits(body_timeout_s=1.0)))) as url:
        u = urlparse(url)
        with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
            t0 = time.time()
            head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 408"), head[:200]
    assert time.time() - t0 < 20 and b"within 1 s" in head


def test_429_and_503_carry_retry_after(served):
    server, url = served
    idle(server)
    held = [server.submit([97, 98, 99], Sampling(max_tokens=110)) for _ in range(3)]
    try:
        while server.health()["active"] < 3:
            time.sleep(0.01)
        held += [server.submit([97, 98, 99], Sampling(max_tokens=110)) for _ in range(2)]
        # n = 2 needs two places and the queue has one: refused whole, nothing of it queued
        r = one_line(httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2,
                                                               "n": 2}, timeout=60), 429, "queue")
        assert int(r.headers["retry-after"]) >= 1
        assert server.health()["queued"] == 2
    finally:
        for s in held:
            s.cancel()
    idle(server)


def test_a_dropped_request_not_streamed_is_cancelled(served, engine, monkeypatch):
    """The client gives up after 1 s on a request of 110 tokens, device calls slowed to 0.5 s
    (4 steps each: 110 tokens take 3.5 s at the very least): the server ends it at once
    instead of generating on for nobody."""
    server, url = served
    idle(server)
    body = {"prompt": [97, 98, 99], "max_tokens": 110, "temperature": 0}
    httpx.post(url + "/v1/completions", json=body | {"max_tokens": 8}, timeout=120)  # compiled
    decode = engine.decode_rows
    monkeypatch.setattr(engine, "decode_rows",
                        lambda *a, **k: (time.sleep(0.5), decode(*a, **k))[1])
    t0 = time.time()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=1.0)
    h = idle(server, timeout=30)
    assert time.time() - t0 < 3.0, "the dropped request ran on"
    assert h["free_pages"] == h["kv_pages"]


def test_an_exception_in_one_prefill_fails_that_request_alone(served, client, solo, engine,
                                                              monkeypatch):
    server, url = served
    penalties = engine.row_penalties

    def faulty(settings):
        if any(s[0] == 1.25 for s in settings):  # presence 1.25 marks the victim
            raise RuntimeError("injected prefill fault")
        return penalties(settings)

    monkeypatch.setattr(engine, "row_penalties", faulty)
    for stream in (False, True):
        body = {"prompt": "abc", "max_tokens": 4, "presence_penalty": 1.25, "stream": stream}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        if not stream:
            one_line(r, 500, "injected prefill fault")
        else:
            events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
            assert json.loads(events[-3])["choices"][0]["finish_reason"] == "error"
            assert "injected prefill fault" in json.loads(events[-2])["error"]["message"]
            assert events[-1] == "[DONE]"
    assert complete(client, PROMPTS[0]).choices[0].text == solo[PROMPTS[0]]
    h = idle(server)
    assert h["status"] == "ok" and h["free_pages"] == h["kv_pages"]


def test_a_row_whose_math_breaks_fails_alone(served, client, solo, engine, monkeypatch):
    """A row given a repetition penalty of 0 on the device (past every host check, as a bug
    there would let it: presence 1.75 marks it): NaN probabilities, tokens outside the
    vocabulary; that request fails with one line, a greedy request beside it returns its solo
    text."""
    import dataclasses

    server, _ = served
    idle(server)
    penalties = engine.row_penalties

    def broken(settings):
        marked = [s[0] == 1.75 for s in settings]
        pen = penalties([(0.0, *s[1:]) if m else s for s, m in zip(settings, marked)])
        return dataclasses.replace(pen, repetition=jnp.where(jnp.asarray(marked), 0.0,
                                                             pen.repetition))

    monkeypatch.setattr(engine, "row_penalties", broken)
    victim = server.submit(list(b"the cat sat on the mat"),
                           Sampling(max_tokens=8, temperature=1.0, presence_penalty=1.75))
    assert complete(client, PROMPTS[3]).choices[0].text == solo[PROMPTS[3]]
    with pytest.raises(RequestFailed, match="outside the vocabulary"):
        victim.result(timeout=120)
    h = idle(server)
    assert h["status"] == "ok" and h["free_pages"] == h["kv_pages"]


def test_engine_death_fails_ready_and_health_ends_streams_and_stops_the_process(
        engine, monkeypatch, capfd):
    """The serving loop itself dies (the device call raises): the stream in flight ends with
    finish_reason "error" and [DONE], /health and /ready answer 503, a new request 503 with
    Retry-After, the cause is on stderr, and `serve_until_stopped` returns (the process exits
    3: `jaxspec.serve.EXIT_ENGINE_DIED`)."""
    from jaxspec import serve

    doomed = Server(engine, slots=2, max_context=CONTEXT, steps_per_call=4, model_name=NAME)
    monkeypatch.setattr(engine, "decode_rows", lambda *a, **k: 1 / 0)
    app = make_app(doomed)
    stopped = threading.Thread(target=serve.serve_until_stopped,
                               args=(uvicorn, app, "127.0.0.1", 0, None, doomed.died))
    try:
        with listening(make_app(doomed)) as url:
            stopped.start()
            body = {"prompt": "abc", "max_tokens": 4, "stream": True}
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
            assert json.loads(events[-3])["choices"][0]["finish_reason"] == "error"
            assert json.loads(events[-2])["error"]["code"] == 503 and events[-1] == "[DONE]"
            assert httpx.get(url + "/health").status_code == 503
            assert httpx.get(url + "/ready").status_code == 503
            r = one_line(post_raw(url, "/v1/completions", b'{"prompt": "a"}'), 503, "stopped")
            assert int(r.headers["retry-after"]) >= 1
            stopped.join(timeout=30)
            assert not stopped.is_alive()
    finally:
        doomed.close()
    err = capfd.readouterr().err
    assert "the serving loop stopped: ZeroDivisionError" in err and "exit status 3" in err
    assert serve.EXIT_ENGINE_DIED == 3


EXTREMES = (0, -1, 1e-300, -1e-300, 1e300, -1e300, 2**63, 0.999999999, 1.0000001, 101)
WRONG_TYPES = (True, "1", [], {})
SWEPT = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
         "repetition_penalty", "seed", "n", "best_of", "logprobs", "max_tokens",
         "max_completion_tokens", "stream", "stream_options", "stop", "stop_token_ids",
         "logit_bias", "echo", "prompt")


def check_answer(r, body) -> bool:
    """A 2xx or a one-line 4xx; a stream ends with [DONE] and no error. -> whether 2xx."""
    assert r.status_code < 500, (body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert "\n" not in r.json()["error"]["message"], r.text
        return False
    if body.get("stream") is True:
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and '"error"' not in r.text, (body, r.text[-300:])
    return True


def test_every_field_at_every_extreme(served, client, solo):
    """Each field the server reads, alone in a good request, at each extreme and wrong type
    (inside lists and maps too: stop_token_ids [x], logit_bias {"3": x} and {x: 1}): never a
    5xx, and the server goes on."""
    server, url = served
    failed, ok = server.health()["failed"], 0
    http = httpx.Client(timeout=120)  # one client: a new one per request costs ~80 ms
    for name in SWEPT:
        for value in EXTREMES + WRONG_TYPES:
            values = {"stop_token_ids": [[value]], "logit_bias": [{"3": value}, {str(value): 1}],
                      "prompt": [[97, value]]}.get(name, []) + [value]
            for v in values:
                body = {"prompt": "abc", "max_tokens": 3, "temperature": 1.0, name: v}
                ok += check_answer(http.post(url + "/v1/completions",
                                             content=json.dumps(body).encode()), body)
    http.close()
    assert ok >= 20
    h = idle(server)
    assert h["status"] == "ok" and h["failed"] == failed and h["free_pages"] == h["kv_pages"]
    assert complete(client, PROMPTS[0]).choices[0].text == solo[PROMPTS[0]]


def _fuzzed_bodies():
    """(path, body) over the request schema: a valid request with up to three fields drawn from
    what the server reads, each valid, at an edge (1e-300, 1e300, 2**63, -1, a lone
    surrogate) or of the wrong type -- mostly one odd value in an otherwise good request, the
    kind that reaches the device."""
    from hypothesis import strategies as st

    extreme, wrong = st.sampled_from(EXTREMES), st.sampled_from(WRONG_TYPES)
    ids = st.one_of(st.integers(0, 255), st.sampled_from([-1, 256, 2**31, -(2**63), 10**30]))
    text = st.one_of(st.text(max_size=8), st.sampled_from(["\ud800", "\udfff x", "\x00", ""]))

    def field(valid):  # numbers: their extremes; anything: a wrong type now and then
        return st.one_of(valid, valid, extreme, extreme, wrong)

    unit = st.floats(0, 1)
    fields = {
        "temperature": field(st.floats(0, 2)), "top_p": field(unit),
        "top_k": field(st.integers(0, 300)), "min_p": field(unit),
        "presence_penalty": field(st.floats(-2, 2)), "frequency_penalty": field(st.floats(-2, 2)),
        "repetition_penalty": field(st.floats(0.01, 100)), "seed": field(st.integers(0, 99)),
        "logit_bias": field(st.dictionaries(ids.map(str), st.floats(-100, 100), max_size=3)),
        "stop": field(st.one_of(text, st.lists(text, max_size=3))),
        "stop_token_ids": field(st.lists(ids, max_size=3)),
        "n": field(st.integers(1, 3)), "best_of": field(st.integers(1, 3)),
        "stream": field(st.booleans()),
        "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "logprobs": field(st.integers(0, 5)), "echo": field(st.booleans()), "user": text,
        "model": field(st.just(NAME)), "response_format": field(st.just({"type": "text"})),
        "suffix": text, "max_completion_tokens": field(st.integers(1, 4)),
        "max_tokens": field(st.integers(1, 4)),
    }

    @st.composite
    def body(draw):
        chat = draw(st.booleans())
        if chat:
            content = draw(field(text))
            out = {"messages": draw(field(st.just([{"role": "user", "content": content}])))}
        else:
            out = {"prompt": draw(field(st.one_of(text.filter(bool),
                                                  st.lists(ids, min_size=1, max_size=4))))}
        out["max_tokens"] = 3
        for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
            out[name] = draw(fields[name])
        return ("/v1/chat/completions" if chat else "/v1/completions"), out

    return body()


def test_fuzzed_requests_never_break_the_server(served, client, solo):
    """Hypothesis over the request schema against the live server: every answer a 2xx or a
    one-line 4xx (a stream: no error event, ends with [DONE]); then the server is ready and a
    greedy request still returns the engine's tokens. Bounded: 60 cases ($JAXSPEC_FUZZ_EXAMPLES
    for a longer run: docs/history/BENCHMARKS-session-28.md)."""
    import os

    from hypothesis import HealthCheck, given, settings

    server, url = served
    seen, failed = {"2xx": 0, "4xx": 0}, server.health()["failed"]
    http = httpx.Client(timeout=120)

    examples = int(os.environ.get("JAXSPEC_FUZZ_EXAMPLES", "60"))

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(_fuzzed_bodies())
    def case(path_body):
        path, body = path_body
        r = http.post(url + path, content=json.dumps(body).encode())
        seen["2xx" if check_answer(r, body) else "4xx"] += 1

    case()
    http.close()
    assert seen["2xx"] >= 5 and seen["4xx"] >= 5, seen
    assert httpx.get(url + "/ready").status_code == 200
    assert complete(client, PROMPTS[2]).choices[0].text == solo[PROMPTS[2]]
    h = idle(server)
    assert h["status"] == "ok" and h["free_pages"] == h["kv_pages"] and h["failed"] == failed
    print(f"fuzzed: {seen}")


def test_the_server_holds_one_decode_program_per_row_width(served, engine):
    """The warm-up's list (`serve.server_programs`): a decode program per row width, each with
    the full page table and sampling mode "any" (no all-greedy twin; the greedy tests above run
    through it); the control: a scheduler of page-table octaves lists one per octave too."""
    from jaxspec.serve import server_programs
    from jaxspec.serving.gate import Limits
    from jaxspec.serving.scheduler import Scheduler

    sched = served[0].scheduler
    decode = [r for r in server_programs(sched, Limits()) if r["name"] == "decode"]
    assert [r["rows"] for r in decode] == list(sched.widths) == [1, 2, 3]
    assert {r["table_pages"] for r in decode} == {sched.max_pages}
    assert {r["program"][1][4].mode for r in decode} == {"any"} and not any(
        "sampling" in r for r in decode)
    octaves = Scheduler(engine, slots=3, max_context=CONTEXT, steps_per_call=4)
    decode = [r for r in server_programs(octaves, Limits()) if r["name"] == "decode"]
    assert len(decode) == len(octaves.widths) * len(octaves.table_widths) > 3


def test_cache_salt_keeps_prefix_hits_within_a_tenant(served):
    """A 40-token prompt (two full pages) cached under salt "a": a request of salt "b" (or none)
    neither shares the pages nor sees them in cached_tokens; salt "a" again does."""
    server, url = served
    prompt = "the quick brown fox jumps over the lazy dog"

    def cached(**salt):
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0} | salt
        r = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="a") == 0
    assert cached(cache_salt="b") == 0 and cached() == 0
    assert cached(cache_salt="a") == 32
    one_line(httpx.post(url + "/v1/completions", json={"prompt": "x", "cache_salt": "s" * 257},
                        timeout=60), 400, "cache_salt")


def test_the_api_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    """Not only --api-key (visible in ps): --api-key-file, $JAXSPEC_API_KEY_FILE,
    $JAXSPEC_API_KEY; an empty or missing file is a one-line error."""
    from jaxspec import serve
    from jaxspec.errors import JaxspecError

    parse = serve.make_parser().parse_args
    monkeypatch.delenv("JAXSPEC_API_KEY", raising=False)
    monkeypatch.delenv("JAXSPEC_API_KEY_FILE", raising=False)
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    assert serve.api_key(parse([])) is None
    assert serve.api_key(parse(["--api-key-file", str(key)])) == "s3cret"
    monkeypatch.setenv("JAXSPEC_API_KEY_FILE", str(key))
    assert serve.api_key(parse([])) == "s3cret"
    monkeypatch.delenv("JAXSPEC_API_KEY_FILE")
    monkeypatch.setenv("JAXSPEC_API_KEY", "from-env")
    assert serve.api_key(parse([])) == "from-env"
    (tmp_path / "empty").write_text("\n")
    for path, word in ((tmp_path / "empty", "empty"), (tmp_path / "none", "cannot read")):
        with pytest.raises(JaxspecError, match=word):
            serve.api_key(parse(["--api-key-file", str(path)]))
