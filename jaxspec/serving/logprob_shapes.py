"""OpenAI response shapes for log-probabilities, from per-token numbers the decode loop returns.

Chat: `choices[].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
Completions: `choices[].logprobs = {"tokens", "token_logprobs", "top_logprobs", "text_offset"}`
(top_logprobs there is one {token: logprob} dict per position). Pure host functions: the caller
passes a `piece(token_id) -> str` so the module needs no tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def _entry(piece: Callable[[int], str], tok: int, lp: float) -> dict:
    text = piece(int(tok))
    return {"token": text, "logprob": float(lp), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    piece: Callable[[int], str],
    tokens: Sequence[int],
    chosen: Sequence[float],
    top_ids: Sequence[Sequence[int]],
    top_values: Sequence[Sequence[float]],
    top_logprobs: int,
) -> dict:
    """Chat `logprobs` object; `top_logprobs` (<= len of each top row) alternatives per token."""
    content = []
    for tok, lp, ids, vals in zip(tokens, chosen, top_ids, top_values, strict=True):
        e = _entry(piece, tok, lp)
        e["top_logprobs"] = [_entry(piece, i, v) for i, v in list(zip(ids, vals))[:top_logprobs]]
        content.append(e)
    return {"content": content}


def completion_logprobs(
    piece: Callable[[int], str],
    tokens: Sequence[int],
    chosen: Sequence[float],
    top_ids: Sequence[Sequence[int]],
    top_values: Sequence[Sequence[float]],
    logprobs: int,
    offset: int = 0,
) -> dict:
    """Completions `logprobs` object; `offset`: the text offset of the first token. With echo
    the prompt's tokens come first, and the very first has no logprob: None in `chosen` and in
    `top_ids` there gives null, as OpenAI's legacy API returns."""
    texts = [piece(int(t)) for t in tokens]
    offsets, at = [], offset
    for t in texts:
        offsets.append(at)
        at += len(t)
    tops: list[dict[str, float] | None] = []
    for ids, vals in zip(top_ids, top_values, strict=True):
        if ids is None:
            tops.append(None)
            continue
        d: dict[str, float] = {}
        for i, v in list(zip(ids, vals))[:logprobs]:
            d.setdefault(piece(int(i)), float(v))  # two ids decoding alike: keep the likelier
        tops.append(d)
    return {
        "tokens": texts,
        "token_logprobs": [None if x is None else float(x) for x in chosen],
        "top_logprobs": tops,
        "text_offset": offsets,
    }
