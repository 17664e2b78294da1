"""A completion request read once, for every endpoint: the prompt's ids (a string, ids, or chat
messages through the tokenizer's template), the model name, max_tokens settled against the
context and the server's limits, the sampling values, streaming, n / best_of, echo, structured
output and the tenant's cache salt, checked in one order, into an `Ask` the replies read
(`serving.replies`). Every refusal is an `HTTPError` with one line."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from jaxspec.errors import JaxspecError
from jaxspec.serving import structured, tool_parse
from jaxspec.serving.answers import failure
from jaxspec.serving.fields import (
    HTTPError,
    best_of_of,
    cache_salt_of,
    chat_messages,
    check_recorded,
    choices_of,
    echo_of,
    refuse_unsupported,
    requested_max_tokens,
    sampling_of,
    wants_stream,
)
from jaxspec.serving.requests import Sampling


@dataclasses.dataclass
class Ask:
    """One request, parsed and checked."""

    rid: str  # the response id (cmpl-..., chatcmpl-...)
    ids: list[int]  # the prompt's token ids
    chat: bool  # /v1/chat/completions
    sampling: Sampling
    streamed: bool
    n: int  # choices returned
    candidates: int  # best_of (>= n; n when not given)
    wanted: structured.Asked  # the response format / tools asked
    echoed: str  # the prompt text echoed ("" without echo)
    echo: tuple | None  # (ids, the prompt's own tokens scored) for echo with logprobs
    salt: bytes  # the prefix cache's namespace


def _clip(n: int) -> str:
    text = str(n)
    return text if len(text) <= 24 else text[:21] + "..."


class Parser:
    """Reads requests for one server (its tokenizer, context, limits, recorded logprobs)."""

    def __init__(self, server, gate):
        self.server, self.gate, self.limits = server, gate, gate.limits
        self.sched = server.scheduler
        self.tokenizer = server.engine.model.tokenizer

    def check_model(self, body) -> None:
        name = body.get("model")
        if name is not None and name != self.server.model_name:
            raise HTTPError(404, f"model {name!r} is not served here: use "
                                 f"{self.server.model_name!r}", "not_found_error")

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise HTTPError(400, "this model has no tokenizer: send 'prompt' as token ids")
            return [int(t) for t in self.tokenizer.encode(prompt)]
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.server.engine.target.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise HTTPError(400, f"field 'prompt' holds token id {_clip(bad)}, outside the "
                                     f"vocabulary: use ids in [0, {vocab})")
            return prompt
        raise HTTPError(400, "field 'prompt' must be a string or a list of token ids (one prompt)")

    def completion_prompt(self, body) -> tuple[list[int], str]:
        """/v1/completions: (the prompt's ids, its text as echo returns it)."""
        if "prompt" not in body:
            raise HTTPError(400, "field 'prompt' is required")
        ids = self.prompt_ids(body["prompt"])
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        return ids, prompt if isinstance(prompt, str) else "".join(self.piece(t) for t in ids)

    def chat_ids(self, body) -> list[int]:
        """/v1/chat/completions: the messages (and tools) through the chat template."""
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        messages = chat_messages(body.get("messages"))
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise HTTPError(400, "this model's tokenizer has no chat template: use /v1/completions")
        extra = {"tools": tools} if tools else {}  # rendered as the model's template does
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      **extra)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def piece(self, tok: int) -> str:
        return self.server.engine.decode_text([int(tok)])

    def settle_max_tokens(self, body, ids) -> int:
        """The request's max_tokens, or all the context (and serving.max_tokens_limit) allows."""
        limits, capacity = self.limits, self.sched.capacity
        if limits.max_prompt_tokens and len(ids) > limits.max_prompt_tokens:
            raise HTTPError(400, f"the prompt is {len(ids)} tokens: serving.max_prompt_tokens "
                                 f"allows {limits.max_prompt_tokens}; shorten it")
        name, asked = requested_max_tokens(body)
        room = capacity - len(ids) - self.sched.spec.depth - 1  # γ + 1 slots for the last step
        if room < 1:
            raise HTTPError(400, f"the prompt is {len(ids)} tokens: serving.max_context="
                                 f"{capacity} leaves no room to generate; shorten it")
        ceiling = min(room, limits.max_tokens or room)
        if asked is None:
            return ceiling
        if asked < 1:
            raise HTTPError(400, f"field {name!r}={asked} must be at least 1")
        if limits.max_tokens and asked > limits.max_tokens:
            raise HTTPError(400, f"field {name!r}={asked} is above serving.max_tokens_limit="
                                 f"{limits.max_tokens}: lower it")
        if asked > room:
            raise HTTPError(400, f"field {name!r}={asked} is too large: a prompt of {len(ids)} "
                                 f"tokens leaves room for {room} (serving.max_context="
                                 f"{capacity}); lower it or shorten the prompt")
        return asked

    def tenant_salt(self, request, body) -> bytes:
        """The request's cache namespace: its cache_salt under its API key (with a key set)."""
        tenant = request.headers.get("authorization", "") if self.gate.api_key else ""
        return cache_salt_of(body, tenant)

    async def ask(self, body, ids, chat: bool, prompt_text: str, request) -> Ask:
        """The request's fields checked (every refusal before anything runs), its grammar
        compiled off the event loop, the echoed prompt scored: an `Ask`."""
        refuse_unsupported(body)
        wanted = structured.asked(body, tool_parse.template_format(self.tokenizer))
        if wanted.constraint is not None and self.sched.grammars is None:
            raise HTTPError(400, f"field {wanted.field!r} is not supported on this server: start "
                                 "it with serving.structured=true")
        if wanted.has_tools and not chat:
            raise HTTPError(400, "tool calls need /v1/chat/completions")
        sampling = sampling_of(body, self.settle_max_tokens(body, ids), chat)
        streamed, n = wants_stream(body), choices_of(body)
        candidates = best_of_of(body, n)
        check_recorded(body, sampling.logprobs, self.sched.spec.logprobs, chat)
        self._check_best_of(streamed, n, candidates)
        echoed = prompt_text if echo_of(body, chat) else ""
        if streamed and n > 1 and wanted.has_tools:
            raise HTTPError(400, f"field 'n'={n} with 'stream': true and tools is not "
                                 "supported yet: set stream false or send n requests")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        if wanted.constraint is not None:  # off the event loop, under its budget
            await asyncio.to_thread(self.sched.grammars.compile, wanted.constraint)
        echo = await self._echoed_scores(ids, sampling.logprobs) if echoed else None
        return Ask(rid, ids, chat, sampling, streamed, n, candidates, wanted, echoed, echo,
                   self.tenant_salt(request, body))

    def _check_best_of(self, streamed: bool, n: int, candidates: int) -> None:
        if candidates > n and streamed:
            raise HTTPError(400, f"field 'best_of'={candidates} with 'stream': true is not "
                                 "supported (the best are known only at the end): set stream false")
        if candidates > n and self.sched.spec.logprobs is None:
            raise HTTPError(400, f"field 'best_of'={candidates} is not supported by this server "
                                 "(it ranks candidates by their recorded logprobs): start it with "
                                 "generation.logprobs=0 or more")

    async def _echoed_scores(self, ids, k):
        """(ids, the prompt's own tokens scored) for echo with logprobs, else None."""
        if k is None:
            return None
        try:
            return ids, await asyncio.to_thread(self.server.prompt_logprobs, ids)
        except JaxspecError as e:
            raise failure(e) from None
