"""tool_choice "auto": tool calls read back from free text in the model family's own format.

The format is the one the family's chat template teaches the model. Qwen2 / Qwen2.5 / Qwen3
(and other Hermes-style templates) render the tools and ask for

    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

so a template that mentions `<tool_call>` is read as Hermes. SmolLM2's and Gemma 3's templates
define no tool-call format: "auto" is refused for them (serving/structured.py), since there is
nothing to parse.

A text becomes calls only when every block parses to {"name": one of the tools, "arguments": an
object} and no tag is left unbalanced; otherwise it stays content, whole (never a guessed call).
Streaming (`Held`) holds text back from the moment a `<tool_call>` tag may be starting, and lets
the text before it out as content.
"""

from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def template_format(tokenizer) -> str | None:
    """The tool-call format the tokenizer's chat template defines: "hermes", or None."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):  # named templates (tokenizer_config's list form)
        template = " ".join(str(t) for t in template.values())
    return "hermes" if isinstance(template, str) and OPEN in template else None


def call(name: str, arguments: dict) -> dict:
    """One OpenAI tool call."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def parse_hermes(text: str, names) -> tuple[str | None, list[dict]] | None:
    """text -> (the content outside the blocks, None when only whitespace; the calls), or None
    when the text holds no call or any block does not parse to a call of one of `names`."""
    if OPEN not in text:
        return None
    calls = []
    for m in _BLOCK.finditer(text):
        try:
            value = json.loads(m.group(1))
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") not in names:
            return None
        args = value.get("arguments", {})
        if isinstance(args, str):  # some models send the arguments as JSON text
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict) or set(value) - {"name", "arguments"}:
            return None
        calls.append(call(value["name"], args))
    rest = _BLOCK.sub("", text)
    if not calls or OPEN in rest or CLOSE in rest:  # an unclosed or stray tag: not a call
        return None
    return (rest if rest.strip() else None), calls


def _partial_open(text: str) -> int:
    """How many trailing characters of `text` could begin an opening tag."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


class Held:
    """A streamed auto response's text: `feed` returns what may go out as content now; `end`
    returns (the content still to send, the calls) once the output is complete."""

    def __init__(self, names):
        self.names = tuple(names)
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content

    def feed(self, piece: str) -> str:
        self.text += piece
        at = self.text.find(OPEN, self.sent)
        upto = at if at >= 0 else len(self.text) - _partial_open(self.text)
        out = self.text[self.sent:max(upto, self.sent)]
        self.sent = max(upto, self.sent)
        return out

    def end(self, text: str, finished: bool) -> tuple[str, list[dict] | None]:
        """text: the whole output; finished: it ended on its own (not cut by max_tokens)."""
        parsed = parse_hermes(text, self.names) if finished else None
        if parsed is None:
            return text[self.sent:], None
        rest = _BLOCK.sub("", text[self.sent:])
        return (rest if rest.strip() else ""), parsed[1]
