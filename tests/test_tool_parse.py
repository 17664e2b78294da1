"""tool_choice "auto" (serving/tool_parse.py): Hermes-style `<tool_call>` blocks, as Qwen2.5 /
Qwen3 write them, read back as calls; anything that does not parse to a call of one of the tools
stays content whole; streaming holds text back from a possible opening tag; a family whose chat
template defines no tool-call format (SmolLM2, Gemma 3) gets a one-line 400 naming the fix."""

from __future__ import annotations

import json

import pytest

from jaxspec.serving import structured, tool_parse
from jaxspec.serving.fields import HTTPError

NAMES = ("get_weather", "get_time")
# recorded outputs in Qwen2.5-Instruct's format (its template asks for exactly this)
ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
TWO = ONE + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>'
SMOLLM2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
           "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN = ("{%- if tools %}...For each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
        "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call>{%- endif %}")


def args(call):
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_one_and_two_calls_parse():
    content, calls = tool_parse.parse_hermes(ONE, NAMES)
    assert content is None and [args(c) for c in calls] == [("get_weather", {"city": "Paris", "unit": "c"})]
    content, calls = tool_parse.parse_hermes("Let me check.\n" + TWO, NAMES)
    assert content == "Let me check.\n\n" and [args(c)[0] for c in calls] == ["get_weather", "get_time"]
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["type"] == "function"


def test_arguments_sent_as_json_text_parse():
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"utc\\"}"}</tool_call>'
    assert args(tool_parse.parse_hermes(text, NAMES)[1][0]) == ("get_time", {"zone": "utc"})


@pytest.mark.parametrize("text", [
    "The weather is fine.",  # no call
    ONE.replace("get_weather", "get_date"),  # no such tool
    ONE.replace('"unit": "c"}', '"unit": "c"'),  # broken JSON
    ONE.replace("</tool_call>", ""),  # never closed (cut, or the model stopped mid-call)
    ONE + "\n<tool_call>\n{\"name\": \"get_time\"",  # a second call left open
    '<tool_call>["get_time"]</tool_call>',  # not an object
    '<tool_call>{"name": "get_time", "arguments": {}, "extra": 1}</tool_call>',  # unknown key
    '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',  # arguments not an object
])
def test_what_does_not_parse_stays_content(text):
    assert tool_parse.parse_hermes(text, NAMES) is None
    a = structured.Asked(auto=NAMES)
    assert structured.answer(a, text, "stop") == (text, None)


def test_a_cut_output_is_never_a_call():
    assert structured.answer(structured.Asked(auto=NAMES), ONE, "length") == (ONE, None)


def stream(pieces, text_done=None, reason="stop"):
    held = structured.Streamed(structured.Asked(auto=NAMES))
    sent = [held.feed(p) for p in pieces]
    rest, calls = held.end(text_done or "".join(pieces), reason)
    return "".join(sent), rest, calls


def test_streaming_holds_back_from_the_opening_tag():
    pieces = ["Let me ", "check.", " <", "tool", "_call>\n{", '"name": "get_time", "arguments": {"zone"',
              ': "cet"}}\n</tool_call>', "\n"]
    sent, rest, calls = stream(pieces)
    assert sent == "Let me check. " and rest == "" and [args(c)[0] for c in calls] == ["get_time"]
    held = structured.Streamed(structured.Asked(auto=NAMES))
    assert held.feed("a <") == "a " and held.feed("b") == "<b"  # "<b" cannot open a tag: sent


def test_streaming_a_text_that_is_not_a_call_sends_it_all():
    pieces = ["x ", ONE[:20], ONE[20:].replace("get_weather", "nope")]
    sent, rest, calls = stream(pieces)
    assert calls is None and sent + rest == "".join(pieces) and sent == "x "


def test_the_family_format_is_read_from_its_chat_template():
    class Tok:
        chat_template = QWEN

    assert tool_parse.template_format(Tok()) == "hermes"
    Tok.chat_template = SMOLLM2
    assert tool_parse.template_format(Tok()) is None
    assert tool_parse.template_format(None) is None


@pytest.mark.parametrize("body", [{"tool_choice": "auto"}, {}])
def test_auto_without_a_family_format_is_a_one_line_400_naming_the_fix(body):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with pytest.raises(HTTPError) as e:
        structured.asked({"tools": tools} | body, None)
    message = e.value.message
    assert e.value.status == 400 and "\n" not in message and "'required'" in message
    a = structured.asked({"tools": tools} | body, "hermes")
    assert a.auto == ("get_time",) and a.constraint is None and not a.tool_call
