"""Structured output on the server (serving.structured, on by default: the fixture's server is
started with no structured setting): with the `openai` client over loopback,
`response_format` json_schema / json_object and `guided_choice` answers equal the engine's own
constrained greedy run and validate; `tool_choice` "required" and a named function return
`tool_calls` whose arguments validate against the tool's schema, streamed and not;
tool_choice "auto" (the template is Hermes-style) reads a `<tool_call>` block back as a call,
streamed and not, and leaves a block naming no tool as content; an unsupported schema keyword
gets a one-line 400, in response_format and in a tool's parameters; sampled outputs of a schema
with integer and number bounds, string lengths and a date format validate both ways in; after
a plain request, a constrained one lowers no program (the grammar is a traced input of the
programs the plain request ran); a server started with serving.structured=false answers one
with a one-line 400 naming the setting."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import schemas  # noqa: E402
from compiles import counting_lowerings  # noqa: E402
from loopback import NAME, byte_chat_model, listening, openai_client  # noqa: E402
from jaxspec.constrain import Constraint  # noqa: E402
from jaxspec.drafters.prompt_lookup import NgramDrafter  # noqa: E402
from jaxspec.engine.runner import Engine  # noqa: E402
from jaxspec.errors import JaxspecError  # noqa: E402
from jaxspec.serving import Server  # noqa: E402
from jaxspec.serving.http import make_app  # noqa: E402

CONTEXT = 160
NEW = 64
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
            "<tool_call>\n{% endif %}"  # Hermes-style: the family's calls are <tool_call> blocks
            "{% if add_generation_prompt %}<assistant>{% endif %}")
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "ok": {"type": "boolean"}},
          "required": ["city", "ok"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["unit", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = byte_chat_model(tmp_path_factory.mktemp("bytes"), TEMPLATE)
    return Engine(model, NgramDrafter(256, 1, 3), num_speculative_tokens=3, max_context=CONTEXT)


@pytest.fixture(scope="module")
def served(engine):
    server = Server(engine, slots=3, max_context=CONTEXT, steps_per_call=4, max_queue=8,
                    model_name=NAME)
    with listening(make_app(server)) as url:
        yield server, url
    server.close()


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served[1])


def solo(engine, prompt, constraint):
    ids = engine.model.tokenizer.encode(prompt)
    r = engine.generate([ids], max_new_tokens=NEW, constraint=constraint)[0]
    return r.text


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_equals_the_engine_and_validates(client, engine, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    kw = dict(model=NAME, prompt="abc", max_tokens=NEW, temperature=0, extra_body={"response_format": fmt})
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    else:
        r = client.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"
        text = r.choices[0].text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == solo(engine, "abc", Constraint(json_schema=SCHEMA))


def test_json_object_and_guided_choice_over_chat(client):
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=NEW, temperature=0,
        extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].message.content in ("alpha", "beta")
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=NEW, temperature=0,
        response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":  # a random model may keep writing an object past NEW tokens
        assert isinstance(json.loads(c.message.content), dict)
    else:  # cut by the budget: every token spent, inside an object
        assert c.finish_reason == "length" and r.usage.completion_tokens == NEW
        assert c.message.content.startswith("{"), c.message.content


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_calls_parse_and_validate(client, stream, choice):
    tool_choice = "required" if choice == "required" else {
        "type": "function", "function": {"name": "get_time"}}
    kw = dict(model=NAME, messages=[{"role": "user", "content": "weather?"}], max_tokens=NEW,
              temperature=0, tools=[WEATHER, TIME], tool_choice=tool_choice)
    if stream:
        calls, reason = [], None
        for chunk in client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            calls += delta.tool_calls or []
            assert not delta.content
            reason = chunk.choices[0].finish_reason or reason
    else:
        r = client.chat.completions.create(**kw)
        calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert r.choices[0].message.content is None
    assert reason == "tool_calls" and len(calls) == 1
    fn = calls[0].function
    if choice == "named":
        assert fn.name == "get_time"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[fn.name]
    jsonschema.validate(json.loads(fn.arguments), schema)


BOUNDED = {"type": "object", "properties": {  # short names: a tool call fits the context
    "n": {"type": "integer", "minimum": 1, "maximum": 5},
    "x": {"type": "number", "minimum": -2, "maximum": 2},
    "t": {"type": "string", "minLength": 1, "maxLength": 3},
    "d": {"type": "string", "format": "date"}}, "required": ["n", "x", "t", "d"],
    "additionalProperties": False}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": BOUNDED}}


def test_sampled_bounded_schemas_validate_in_response_format_and_tools(client):
    """The reported case: a tool's {"type": "integer", "minimum": 1, "maximum": 5} once came
    back 1000. Sampled (temperature 1), both ways in, every keyword of BOUNDED is enforced."""
    fmt = {"type": "json_schema", "json_schema": {"name": "b", "schema": BOUNDED}}
    kw = dict(model=NAME, max_tokens=100, temperature=1.0, seed=0)
    r = client.chat.completions.create(messages=[{"role": "user", "content": "go"}],
                                       response_format=fmt, **kw)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    schemas.validate(json.loads(r.choices[0].message.content), BOUNDED)
    r = client.chat.completions.create(messages=[{"role": "user", "content": "find"}],
                                       tools=[SEARCH], tool_choice="required", **kw)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    schemas.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), BOUNDED)


@pytest.mark.parametrize("extra, word", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}}, "oneOf"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2}}}}}],
      "tool_choice": "required"}, "multipleOf"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "contentEncoding": "base64"}}}}, "contentEncoding"),
    ({"tool_choice": "auto"}, "'tools'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    # refused before compiling: the automaton needs more states than the table holds
    ({"guided_regex": "[a-z]{5000}"}, "5001 automaton states"),
    ({"guided_regex": "(ab|c){1,100000}"}, "automaton states"),
])
def test_unsupported_constraints_get_a_one_line_400(served, extra, word):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | extra
    r = httpx.post(served[1] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "\n" not in message and word in message, message


CALL = r'<tool_call>\{"name":"get_time","arguments":\{"zone":"(utc|cet)"\}\}</tool_call>'


def auto_answer(client, stream, regex):
    """tool_choice "auto" with the text forced by guided_regex (a random model writes no call on
    its own) -> (content, calls, finish reason)."""
    kw = dict(model=NAME, messages=[{"role": "user", "content": "t?"}], max_tokens=88,
              temperature=0, tools=[WEATHER, TIME], tool_choice="auto",
              extra_body={"guided_regex": regex})
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        return c.message.content, c.message.tool_calls or [], c.finish_reason
    content, calls, reason = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        reason = chunk.choices[0].finish_reason or reason
    return content or None, calls, reason


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_reads_the_hermes_call(client, stream):
    content, calls, reason = auto_answer(client, stream, "Sure\\. " + CALL)
    assert reason == "tool_calls" and len(calls) == 1 and content == "Sure. "
    assert calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments)["zone"] in ("utc", "cet")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_leaves_a_call_of_no_tool_as_content(client, stream):
    content, calls, reason = auto_answer(client, stream, CALL.replace("get_time", "get_date"))
    assert reason == "stop" and not calls
    assert content.startswith("<tool_call>") and "get_date" in content


def test_grammar_tables_are_kept_within_their_byte_budget(engine):
    """An LRU of host tables bounded by bytes: three constraints through a budget of one; the
    evicted ones compile again when admitted, their rows start where a fresh table puts them."""
    from jaxspec.serving.grammars import GrammarSlots

    regexes = ["(yes|no)", "[0-9]{2}", "(red|green|blue)"]
    compiler = GrammarSlots(engine, 2).compiler
    one = max(sum(x.nbytes for x in compiler.tables(Constraint(regex=r))[:2]) for r in regexes)
    slots = GrammarSlots(engine, 2, cache_bytes=one)
    with pytest.raises(JaxspecError, match="bytes of tables"):  # refused before it compiles
        slots.compile(Constraint(regex="[a-z]{40}"))
    for r in regexes:
        slots.compile(Constraint(regex=r))
        assert slots.cached_bytes <= one
    slots.admit([regexes[0], regexes[2]], [0, 1], set())
    fresh = GrammarSlots(engine, 2)
    for r in (regexes[0], regexes[2]):
        fresh.compile(Constraint(regex=r))
    fresh.admit([regexes[0], regexes[2]], [0, 1], set())
    assert slots.rows(regexes[::2]).state.tolist() == fresh.rows(regexes[::2]).state.tolist()


def test_a_constrained_request_after_a_plain_one_lowers_no_program(served, client):
    """Issue 60 item 6: response_format and tools on a server started with no setting, paid
    as traced inputs of the programs a plain request already ran (jax's lowering events)."""
    plain = dict(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                 temperature=0.7, seed=1)
    salt = iter(range(4))  # whole-prompt programs each time: no prefix-cache tail program
    ask = lambda **kw: client.chat.completions.create(  # noqa: E731
        **plain, **kw, extra_body={"cache_salt": f"lowering-{next(salt)}"})
    # warm, as /ready: the sampled rows' programs at both prompts' buckets, free rows only
    ask()
    ask(tools=[WEATHER], tool_choice="none")
    with counting_lowerings() as lowered:
        r = ask(response_format={"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": SCHEMA}})
        assert r.choices[0].message.content.startswith("{")
        r = ask(tools=[WEATHER], tool_choice="required")
        assert r.choices[0].finish_reason in ("tool_calls", "length")
        assert lowered() == 0, f"{lowered()} programs lowered for a constrained request"


def test_a_server_with_structured_off_refuses_in_one_line(engine):
    server = Server(engine, slots=1, max_context=CONTEXT, model_name=NAME, structured=False)
    try:
        with listening(make_app(server)) as url:
            body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4, "response_format": {"type": "json_object"}}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    finally:
        server.close()
    assert r.status_code == 400 and "serving.structured=true" in r.text
    assert "\n" not in r.json()["error"]["message"]
