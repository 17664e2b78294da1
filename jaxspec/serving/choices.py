"""One choice of an OpenAI response, from a finished request (`requests.Completion`): its text
or tool calls, its finish reason, its `logprobs` object. Pure functions: the HTTP layer
(serving/http.py) passes `piece(token_id) -> str`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from jaxspec.serving import structured
from jaxspec.serving.logprob_shapes import chat_logprobs, completion_logprobs

# the logprob returned for a token the request's filters cut (-inf: not JSON), as OpenAI's API
FLOOR = -9999.0


def logprobs_block(piece: Callable[[int], str], done, returned: int, k, chat: bool, echo=None):
    """The choice's `logprobs` in OpenAI's shape (None when not asked for) from a finished
    request's first `returned` tokens. echo: (prompt ids, their scores) when the prompt comes
    back: its tokens first, the first unscored."""
    if k is None or done.logprobs is None:
        return None
    finite = lambda x: x if math.isfinite(x) else FLOOR  # noqa: E731  JSON has no -inf
    tokens, entries, unscored = list(done.token_ids[:returned]), done.logprobs[:returned], []
    if echo is not None:
        ids, scores = echo
        tokens, entries, unscored = list(ids) + tokens, list(scores) + list(entries), [None]
    args = (piece, tokens, unscored + [finite(e["logprob"]) for e in entries],
            unscored + [[i for i, _ in e["top"]] for e in entries],
            unscored + [[finite(v) for _, v in e["top"]] for e in entries], k)
    return chat_logprobs(*args) if chat else completion_logprobs(*args)


def message_choice(index: int, wanted, done, reason: str, lp, chat: bool,
                   echoed: str = "") -> dict:
    """One non-streamed choice: the text, or the tool calls a finished call parses to."""
    content, calls = structured.answer(wanted, done.text, reason)
    choice = {"index": index, "finish_reason": "tool_calls" if calls else reason,
              "logprobs": lp}
    if calls:
        choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
    elif chat:
        choice["message"] = {"role": "assistant", "content": done.text}
    else:
        choice["text"] = echoed + done.text
    return choice
