"""The request fields of structured output and tool calls, read into a `Constraint` (and back
out of the constrained text into `tool_calls`).

    response_format  {"type": "json_schema", "json_schema": {"schema": ...}} | {"type": "json_object"}
                     | {"type": "text"} (free)
    guided_json / guided_regex / guided_choice   vLLM's extensions (at most one constraint)
    tools + tool_choice   "required": the output is one call {"name": ..., "arguments": {...}}
                          of one of the tools (anyOf over their argument schemas); a named
                          function {"type": "function", "function": {"name": N}}: the output is
                          N's arguments object. "none": free text (the tools still rendered
                          through the chat template). "auto" (also when tool_choice is absent):
                          free text, read back as calls in the family's tool-call format
                          (serving/tool_parse.py); a family whose template defines none gets a
                          400 naming "required" / a named function. A guided_* field or
                          response_format may constrain an auto answer's text.

The call is returned in OpenAI's form (`tool_calls`, finish_reason "tool_calls"), streamed as
one delta at the end: the constraint makes the arguments parse, so nothing is guessed; an auto
output that does not parse as calls stays content.
"""

from __future__ import annotations

import dataclasses
import json

from jaxspec.constrain import Constraint
from jaxspec.constrain.host import make_constraint
from jaxspec.errors import JaxspecError
from jaxspec.serving import tool_parse
from jaxspec.serving.fields import HTTPError

FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "tools", "tool_choice")


@dataclasses.dataclass(frozen=True)
class Asked:
    """What a request constrains: the constraint (None: free) and, for a tool call, how to read
    the output back (`named`: the function whose arguments the output is; else one of
    `tools`, the output {"name", "arguments"})."""

    constraint: Constraint | None = None
    tools: tuple[str, ...] = ()  # tool_choice "required": the callable names
    named: str | None = None  # tool_choice naming a function
    field: str = ""  # the request field that asked for it (named in errors)
    auto: tuple[str, ...] = ()  # tool_choice "auto": the callable names, parsed from free text

    @property
    def tool_call(self) -> bool:
        """The output is constrained to be a call."""
        return bool(self.tools) or self.named is not None

    @property
    def has_tools(self) -> bool:
        """The output is (or may be) read back as tool calls."""
        return self.tool_call or bool(self.auto)


def _schema_of(fmt) -> object:
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise HTTPError(400, "response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                             "\"schema\": {...}}}")
    return spec["schema"]


def _tools(body) -> dict[str, dict]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise HTTPError(400, "field 'tools' must be a list of {type: function, function: {...}}")
    out = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise HTTPError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                 "{\"name\": ..., \"parameters\": {...}}}")
        out[fn["name"]] = fn.get("parameters") or {"type": "object"}
    return out


def asked(body: dict, tool_format: str | None = None) -> Asked:
    """The request's constraint; a one-line 400 for a malformed or unsupported one.
    tool_format: the model family's tool-call format (`tool_parse.template_format`), which
    tool_choice "auto" parses; None refuses "auto"."""
    try:
        return _asked(body, tool_format)
    except JaxspecError as e:
        raise HTTPError(400, str(e)) from None


def _asked(body: dict, tool_format: str | None) -> Asked:
    given = {}
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            given["response_format"] = dict(json_schema=_schema_of(fmt))
        elif kind == "json_object":
            given["response_format"] = dict(json_object=True)
        elif kind != "text":
            raise HTTPError(400, f"response_format type {kind!r} is not supported: use text, "
                                 "json_object or json_schema")
    for name, key in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                      ("guided_choice", "choice")):
        if body.get(name) is not None:
            given[name] = {key: body[name]}
    tools = _tools(body)
    choice = body.get("tool_choice")
    auto = ()
    if choice == "auto" or (choice is None and tools):
        if not tools:
            raise HTTPError(400, "field 'tool_choice' needs 'tools'")
        if tool_format is None:
            raise HTTPError(400, "tool_choice 'auto' (the default with 'tools') is not supported by "
                                 "this model: its chat template defines no tool-call format to read "
                                 "calls from; send tool_choice 'required' or name the function")
        auto, choice = tuple(tools), "none"
    if choice is None or choice == "none":
        tool = None
    elif not tools:
        raise HTTPError(400, "field 'tool_choice' needs 'tools'")
    elif choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                  "required": ["name", "arguments"]} for n, p in tools.items()]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        tool = Asked(make_constraint(json_schema=schema), tools=tuple(tools), field="tool_choice")
    elif isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        name = choice["function"]["name"]
        if name not in tools:
            raise HTTPError(400, f"tool_choice names {name!r}, which is not in 'tools'")
        tool = Asked(make_constraint(json_schema=tools[name]), named=name, field="tool_choice")
    else:
        raise HTTPError(400, f"tool_choice={choice!r} is invalid: use 'none', 'required' or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if tool is not None:
        given["tool_choice"] = None
    if len(given) > 1:
        raise HTTPError(400, f"{' and '.join(sorted(given))} both constrain the output: send one")
    if tool is not None:
        return tool
    if not given:
        return Asked(auto=auto)
    field, kwargs = next(iter(given.items()))
    return Asked(make_constraint(**kwargs), field=field, auto=auto)


def tool_calls(a: Asked, text: str) -> list[dict] | None:
    """The constrained output as OpenAI tool_calls (None: not a tool call, or unfinished)."""
    if not a.tool_call:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None  # cut by max_tokens: finish_reason "length", the text as it is
    if a.named is not None:
        return [tool_parse.call(a.named, value)]
    return [tool_parse.call(value["name"], value["arguments"])]


def answer(a: Asked, text: str, reason: str) -> tuple[str | None, list[dict] | None]:
    """A finished output -> (content, tool calls): a constrained call parsed, an auto output
    read in the family's format (content: the text outside the calls), else (text, None)."""
    if reason != "stop":
        return text, None
    if a.auto:
        parsed = tool_parse.parse_hermes(text, a.auto)
        return (text, None) if parsed is None else parsed
    calls = tool_calls(a, text)
    return (None, calls) if calls else (text, None)


class Streamed:
    """What a streamed answer sends: `feed(piece)` -> the content to send now (a constrained
    call holds everything back; auto, from a possible opening tag on); `end(text, reason)` ->
    (the content still to send, the calls or None)."""

    def __init__(self, a: Asked):
        self.a = a
        self.held = tool_parse.Held(a.auto) if a.auto else None

    def feed(self, piece: str) -> str:
        if self.held is not None:
            return self.held.feed(piece)
        return "" if self.a.tool_call else piece

    def end(self, text: str, reason: str) -> tuple[str, list[dict] | None]:
        if self.held is not None:
            return self.held.end(text, reason == "stop")
        if not self.a.tool_call:
            return "", None
        calls = tool_calls(self.a, text) if reason == "stop" else None
        return ("" if calls else text), calls
