"""The one reader of a request body: size counted while it arrives (a chunked upload is refused
with a 413 as soon as it passes `serving.max_body_bytes`, never read whole), time bounded (a body
not whole within `Limits.body_timeout_s` gets a 408: a client trickling bytes, or announcing
more than it sends, holds no connection open for ever), nesting depth
bounded before the JSON parser recurses, numbers finite (no NaN / Infinity / 1e999), strings
valid Unicode (no lone surrogates), and a JSON object at the top. Every refusal is an
`HTTPError` with a one-line message: a 4xx, never a 500."""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

import numpy as np

from jaxspec.serving.fields import HTTPError

MAX_DEPTH = 64  # a JSON schema inside a tool nests two levels per schema level
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


async def read_body(request, limit: int, within_s: float = 0.0) -> dict[str, Any]:
    """The request's JSON object, read chunk by chunk (`limit` bytes at most; 0: no limit) within
    `within_s` seconds (0: no limit). A client gone before its body is whole gets a 400 (sent
    nowhere) instead of the ASGI app's traceback on stderr."""
    from starlette.requests import ClientDisconnect

    try:
        raw = await asyncio.wait_for(_read(request, limit), within_s or None)
    except asyncio.TimeoutError:
        raise HTTPError(408, f"the request body did not arrive whole within {within_s:g} s: "
                             "send it at once", "request_timeout") from None
    except ClientDisconnect:
        raise HTTPError(400, "the client went away before its request body arrived") from None
    return parse(raw)


async def _read(request, limit: int) -> bytes:
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if limit and size > limit:
            raise HTTPError(413, f"the request body passed {limit} bytes "
                                 f"(serving.max_body_bytes): send a smaller one",
                            "request_too_large")
        parts.append(chunk)
    return b"".join(parts)


def parse(raw: bytes) -> dict[str, Any]:
    """A body's bytes -> its JSON object, checked as the module says."""
    deepest = depth(raw)
    if deepest > MAX_DEPTH:
        raise HTTPError(400, f"the request body nests {deepest} levels deep: at most "
                             f"{MAX_DEPTH} are accepted")
    try:
        body = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except HTTPError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise HTTPError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    _check_strings(body, "")
    return body


def depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text, strings skipped (vectorized:
    a megabyte in milliseconds; wrong JSON gives some number, and the parser refuses it)."""
    bare = np.frombuffer(_STRINGS.sub(b'""', raw), np.uint8)
    step = (np.isin(bare, (ord("["), ord("{"))).astype(np.int32)
            - np.isin(bare, (ord("]"), ord("}"))).astype(np.int32))
    return int(np.cumsum(step).max(initial=0))


def _refuse_constant(name: str):
    raise HTTPError(400, f"the request body holds {name}: numbers must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise HTTPError(400, f"the request body holds {text[:40]}, which overflows a float: "
                             "numbers must be finite")
    return value


def _check_strings(value, where: str) -> None:
    """400 for a string (or key) that is not valid Unicode (a lone surrogate from \\ud800)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise HTTPError(400, f"field {where or 'body'!r} holds a lone surrogate: send valid "
                                 "Unicode") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key, where)
            _check_strings(item, f"{where}.{key}" if where else str(key)[:40])
    elif isinstance(value, list):
        for item in value:
            _check_strings(item, where)
