"""An OpenAI-style request body read honestly: every field is either honoured or refused with a
one-line 400 naming it (`HTTPError`), never silently ignored.

Honoured: model, prompt / messages (content as a string or a list of text parts), max_tokens /
max_completion_tokens, temperature, top_p, stop, seed, stream, stream_options, user, and the
extensions top_k, min_p, stop_token_ids; structured output (serving/structured.py:
response_format, tools with tool_choice "required" or a named function, guided_json /
guided_regex / guided_choice). Accepted only at their neutral value (anything else is
"not supported yet"): n / best_of 1, logprobs / top_logprobs / echo off, the penalties 0 (1 for
repetition_penalty), logit_bias empty, functions absent, suffix empty.
"""

from __future__ import annotations

from typing import Any

from jaxspec.serving.requests import Sampling


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


HONOURED = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
            "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed", "stream",
            "stream_options", "user", "parallel_tool_calls",
            # structured output (serving/structured.py; a server without serving.structured
            # answers a constraint with a one-line 400 naming the setting)
            "response_format", "guided_json", "guided_regex", "guided_choice", "tools",
            "tool_choice"}
# field -> (its neutral values, what a client gets instead)
NEUTRAL: dict[str, tuple[tuple, str]] = {
    "n": ((1,), "one completion per request"),
    "best_of": ((1,), "one completion per request"),
    "logprobs": ((False,), "no log-probabilities are returned"),
    "top_logprobs": ((0,), "no log-probabilities are returned"),
    "echo": ((False,), "the prompt is not echoed"),
    "presence_penalty": ((0,), "no penalties are applied"),
    "frequency_penalty": ((0,), "no penalties are applied"),
    "repetition_penalty": ((1,), "no penalties are applied"),
    "logit_bias": (({},), "logits are not biased"),
    "functions": (([],), "no function calls are produced"),
    "function_call": (("none",), "no function calls are produced"),
    "suffix": (("",), "no suffix is appended"),
}
ROLES = ("system", "user", "assistant")


def refuse_unsupported(body: dict[str, Any]) -> None:
    """400 for the first field that would otherwise be ignored."""
    for name, value in body.items():
        if name in HONOURED or value is None:
            continue
        if name not in NEUTRAL:
            raise HTTPError(400, f"field {name!r} is not supported: remove it")
        neutral, instead = NEUTRAL[name]
        if not any(value == v and isinstance(value, bool) == isinstance(v, bool)
                   for v in neutral):
            raise HTTPError(400, f"field {name!r}={_short(value)} is not supported yet "
                                 f"({instead}): remove it")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _field(body, name, kinds, default):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise HTTPError(400, f"field {name!r}={_short(value)} must be {names}")
    return value


def requested_max_tokens(body: dict[str, Any]) -> tuple[str, int | None]:
    """(the field's name as sent, its value or None when absent)."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else (
        "max_tokens")
    return name, _field(body, name, (int,), None)


def sampling_of(body: dict[str, Any], max_tokens: int) -> Sampling:
    """The request's Sampling (OpenAI's default temperature 1), `max_tokens` already settled."""
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise HTTPError(400, "field 'stop' must be a string or a list of strings")
    ids = _field(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise HTTPError(400, "field 'stop_token_ids' must be a list of integers")
    return Sampling(
        temperature=_field(body, "temperature", (int, float), 1.0),
        top_k=_field(body, "top_k", (int,), 0),
        top_p=_field(body, "top_p", (int, float), 1.0),
        min_p=_field(body, "min_p", (int, float), 0.0),
        max_tokens=max_tokens,
        stop=tuple(stop),
        stop_token_ids=tuple(ids),
        seed=_field(body, "seed", (int,), None),
    )


def wants_stream(body: dict[str, Any]) -> bool:
    return _field(body, "stream", (bool,), False)


def chat_messages(messages) -> list[dict[str, str]]:
    """[{role, content: str}] from the request's messages: content as a string or as a list of
    text parts (joined with newlines); roles system / user / assistant."""
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "field 'messages' must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise HTTPError(400, f"messages[{i}] must be an object {{role, content}}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise HTTPError(400, f"messages[{i}].role={_short(role)} is not supported yet: "
                                 f"use {', '.join(ROLES)}")
        extra = sorted(k for k in m if k not in ("role", "content", "name") and m[k] is not None)
        if extra:
            raise HTTPError(400, f"messages[{i}].{extra[0]} is not supported yet: remove it")
        if isinstance(content, list):
            content = "\n".join(_text_part(p, i, j) for j, p in enumerate(content))
        if not isinstance(content, str):
            raise HTTPError(400, f"messages[{i}].content must be a string or a list of text "
                                 "parts")
        out.append({"role": role, "content": content})
    return out


def _text_part(part, i: int, j: int) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
            part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise HTTPError(400, f"messages[{i}].content[{j}] of type {_short(kind)} is not "
                             "supported yet: send {\"type\": \"text\", \"text\": ...} parts")
    return part["text"]
