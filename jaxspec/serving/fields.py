"""An OpenAI-style request body read honestly: every field is either honoured or refused with a
one-line 400 naming it (`HTTPError`), never silently ignored.

Honoured: model, prompt / messages (content as a string or a list of text parts), max_tokens /
max_completion_tokens, temperature, top_p, stop, seed, stream, stream_options, user, n (up to
16; seeds seed + i; streamed too), logprobs / top_logprobs (up to 20), presence / frequency / repetition
penalties and logit_bias (applied in the decode loop, lossless), and the extensions top_k,
min_p, stop_token_ids; structured output (serving/structured.py: response_format, tools with
tool_choice "required" or a named function, guided_json / guided_regex / guided_choice); echo on
/v1/completions (the prompt returned before the completion, and with logprobs its own tokens
scored: the first null, as OpenAI's legacy API); best_of (n..16 candidates, the n with the
highest summed logprob returned); cache_salt (the prefix cache's namespace, with the API key).
Numbers are checked to where the math is defined (`Sampling`, `limits.sampling_problem`). Accepted
only at their neutral value (anything else is "not
supported yet"): echo off on chat, functions absent, suffix empty.
"""

from __future__ import annotations

import hashlib
from typing import Any

from jaxspec.serving.requests import Sampling


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


HONOURED = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
            "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed", "stream",
            "stream_options", "user", "parallel_tool_calls", "n", "logprobs", "top_logprobs",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
            # structured output (serving/structured.py; a server without serving.structured
            # answers a constraint with a one-line 400 naming the setting)
            "response_format", "guided_json", "guided_regex", "guided_choice", "tools",
            "tool_choice", "echo", "best_of", "cache_salt"}
MAX_N = 16  # completions per request
MAX_TOP_LOGPROBS = 20
# field -> (its neutral values, what a client gets instead)
NEUTRAL: dict[str, tuple[tuple, str]] = {
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


def choices_of(body: dict[str, Any]) -> int:
    """n: completions asked for, 1..MAX_N."""
    n = _field(body, "n", (int,), 1)
    if not 1 <= n <= MAX_N:
        raise HTTPError(400, f"field 'n'={n} is out of range: use 1..{MAX_N}")
    return n


def best_of_of(body: dict[str, Any], n: int) -> int:
    """best_of: candidates generated, n..MAX_N (default n); the n likeliest are returned."""
    best = _field(body, "best_of", (int,), n)
    if not n <= best <= MAX_N:
        raise HTTPError(400, f"field 'best_of'={best} is out of range: use n ({n})..{MAX_N}")
    return best


def logprobs_of(body: dict[str, Any], chat: bool) -> int | None:
    """Top alternatives asked per token (None: no logprobs). Chat: `logprobs` true, with
    `top_logprobs` 0..20; completions: `logprobs` 0..20."""
    if chat:
        on = _field(body, "logprobs", (bool,), False)
        top = _field(body, "top_logprobs", (int,), None)
        if top is not None and not on:
            raise HTTPError(400, "field 'top_logprobs' is not supported without 'logprobs': "
                                 "true: send both")
        k = top or 0
    else:
        if body.get("top_logprobs") is not None:
            raise HTTPError(400, "field 'top_logprobs' is for chat: on completions send "
                                 "'logprobs': N")
        k = _field(body, "logprobs", (int,), None)
        on = k is not None
    if not on:
        return None
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        name = "top_logprobs" if chat else "logprobs"
        raise HTTPError(400, f"field {name!r}={k} is out of range: use 0..{MAX_TOP_LOGPROBS}")
    return k


def check_recorded(body: dict[str, Any], asked: int | None, recorded: int | None,
                   chat: bool) -> None:
    """400 when the request asks more top logprobs than the server's programs record
    (`generation.logprobs`; None: none recorded)."""
    if asked is None or (recorded is not None and asked <= recorded):
        return
    name = "top_logprobs" if chat and body.get("top_logprobs") is not None else "logprobs"
    raise HTTPError(400, f"field {name!r}={_short(body[name])} is not supported by this server "
                         f"(it records {recorded if recorded else 'no'} top logprobs): start it "
                         "with generation.logprobs=20")


def _logit_bias(body) -> tuple[tuple[int, float], ...]:
    bias = _field(body, "logit_bias", (dict,), {})
    out = []
    for key, value in bias.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise HTTPError(400, f"field 'logit_bias' key {_short(key)} is not a token id") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HTTPError(400, f"field 'logit_bias' value {_short(value)} must be a number")
        out.append((tok, float(value)))
    return tuple(sorted(out))


def sampling_of(body: dict[str, Any], max_tokens: int, chat: bool = False) -> Sampling:
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
        presence_penalty=_field(body, "presence_penalty", (int, float), 0.0),
        frequency_penalty=_field(body, "frequency_penalty", (int, float), 0.0),
        repetition_penalty=_field(body, "repetition_penalty", (int, float), 1.0),
        logit_bias=_logit_bias(body),
        logprobs=logprobs_of(body, chat),
    )


MAX_SALT = 256  # characters of a cache_salt


def cache_salt_of(body: dict[str, Any], tenant: str = "") -> bytes:
    """The prefix cache's namespace for this request: its `cache_salt` (a string) with the
    client's API key (`tenant`: requests under different keys never share cached pages, nor
    learn through `cached_tokens` what another's prompts hold). b"": the shared namespace."""
    salt = _field(body, "cache_salt", (str,), "")
    if len(salt) > MAX_SALT:
        raise HTTPError(400, f"field 'cache_salt' is {len(salt)} characters: use at most "
                             f"{MAX_SALT}")
    if not salt and not tenant:
        return b""
    return hashlib.sha256(tenant.encode() + b"\0" + salt.encode()).digest()


def echo_of(body: dict[str, Any], chat: bool) -> bool:
    """Whether the prompt comes back before the completion (/v1/completions only)."""
    echo = _field(body, "echo", (bool,), False)
    if echo and chat:
        raise HTTPError(400, "field 'echo' is not supported on chat (a reply never repeats "
                             "the messages): use /v1/completions or remove it")
    return echo


STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")  # booleans (usage always comes)


def wants_stream(body: dict[str, Any]) -> bool:
    """`stream`, with `stream_options` an object of STREAM_OPTIONS booleans."""
    streamed = _field(body, "stream", (bool,), False)
    options = _field(body, "stream_options", (dict,), None)
    for key, value in (options or {}).items():
        if key not in STREAM_OPTIONS:
            raise HTTPError(400, f"field 'stream_options' key {_short(key)} is not supported: "
                                 f"use {', '.join(STREAM_OPTIONS)}")
        if not isinstance(value, bool):
            raise HTTPError(400, f"field 'stream_options.{key}'={_short(value)} must be bool")
    return streamed


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
