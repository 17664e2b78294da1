"""Make data/agent_sessions.jsonl: multi-turn sessions of the default target acting as a tool agent.

    python scripts/make_agent_workload.py [--sessions 10] [--out data/agent_sessions.jsonl]

Each session is one GSM8K-train question (never the evaluation set) worked by the target itself
(greedy, plain decoding, at most 96 new tokens per call) through a small agent harness:

  call 1  system prompt with the tool schema and one worked exchange (both repeated verbatim
          every call) + the question;
          the model should answer with a JSON tool call {"tool": "python", "code": "..."}
  tool    the call is parsed and its code run in a fresh `python -I` (2 s limit); its output, or
          the parse / run error when the call is malformed, is fed back as a `tool` message
  call 2  the harness quotes the model's call and the tool's output back and asks for a revision
          (a corrected call, run again) or the answer
  call 3  asks for the final structured answer {"answer": <number>, "reason": "..."}
  call 4  only when call 3 was not valid JSON with an "answer": the parse error quoted, again

Every call's prompt is the whole conversation so far (what an agent loop sends), so later calls
repeat the schema, earlier tool calls and tool results. A line holds the session's calls: the
messages sent (render them with the tokenizer's chat template, add_generation_prompt) and the
output the target produced.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA_NAME = Path("shared", "data", "gsm8k_train.jsonl")
# the repo's sibling `shared/` (CI layout), else a `shared/` inside the checkout
GSM8K_TRAIN = next((p for p in (REPO.parent / DATA_NAME, REPO / DATA_NAME) if p.is_file()),
                   REPO.parent / DATA_NAME)
MAX_NEW_TOKENS = 96

TOOLS = [
    {
        "name": "python",
        "description": "Run a Python 3 snippet and return what it prints (stdout, or the error).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python code that prints"}},
            "required": ["code"],
        },
    }
]
SYSTEM = (
    "You are a careful math agent. You can call tools. Available tools (JSON schema):\n"
    + json.dumps(TOOLS, indent=1)
    + "\nTo call a tool, reply with one JSON object and nothing else, for example:\n"
    '{"tool": "python", "code": "print(48 + 48 / 2)"}\n'
    'When you know the result, reply with {"answer": <number>, "reason": "<one sentence>"}.'
)

# one worked exchange before the question (a few-shot demonstration, as agent prompts carry)
DEMO = [
    {"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she "
     "sold half as many clips in May. How many clips did Natalia sell altogether?"},
    {"role": "assistant", "content": '{"tool": "python", "code": "april = 48\\nmay = april / 2\\n'
     'print(april + may)"}'},
    {"role": "tool", "content": "72.0"},
    {"role": "assistant", "content": '{"answer": 72, "reason": "48 in April plus 24 in May."}'},
]


def tool_call(text: str) -> tuple[dict | None, str]:
    """(the first JSON object in the model's reply, '' or why it is not a usable tool call)."""
    match = re.search(r"\{.*\}", text, re.S)
    if match is None:
        return None, "error: no JSON object found in the reply; reply with one JSON object"
    try:
        call = json.loads(match.group(0))
    except json.JSONDecodeError as e:
        return None, f"error: invalid JSON ({e.msg} at char {e.pos}); reply with one JSON object"
    if not isinstance(call, dict):
        return None, "error: the tool call must be a JSON object"
    return call, ""


def run_python(code: str) -> str:
    """The tool: a fresh isolated interpreter, 2 s, stdout + stderr tail."""
    try:
        done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                              timeout=2)
    except subprocess.TimeoutExpired:
        return "error: timed out after 2 s"
    out = (done.stdout + done.stderr).strip()
    return out[-400:] if out else "(no output: print the result)"


def tool_result(reply: str) -> tuple[str, dict | None]:
    call, error = tool_call(reply)
    if error:
        return error, None
    if "answer" in call and "tool" not in call:
        return "error: expected a tool call here, got an answer; call python to check it", call
    if call.get("tool") != "python" or not isinstance(call.get("code"), str):
        return 'error: unknown tool call; use {"tool": "python", "code": "..."}', call
    return run_python(call["code"]), call


def session(engine, tokenizer, question: str) -> list[dict]:
    calls = []
    messages = [{"role": "system", "content": SYSTEM}, *DEMO, {"role": "user", "content": question}]

    def ask() -> str:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
        result = engine.generate([list(ids)], max_new_tokens=MAX_NEW_TOKENS)[0]
        calls.append({"messages": [dict(m) for m in messages], "output": result.text,
                      "output_tokens": result.num_generated_tokens})
        messages.append({"role": "assistant", "content": result.text})
        return result.text

    reply = ask()
    result, _ = tool_result(reply)
    messages.append({"role": "tool", "content": result})
    messages.append({"role": "user", "content": (
        f"You called:\n{reply.strip()}\nThe tool returned:\n{result}\n"
        "If that is wrong, call the tool again with fixed code; otherwise reply with the answer."
    )})
    reply = ask()
    call, error = tool_call(reply)
    if call is not None and "tool" in call:
        result, _ = tool_result(reply)
        messages.append({"role": "tool", "content": result})
    messages.append({"role": "user", "content": (
        f"Your last reply was:\n{reply.strip()}\n"
        'Give the final answer now, as JSON only: {"answer": <number>, "reason": "<one sentence>"}.'
    )})
    reply = ask()
    call, error = tool_call(reply)
    if error or "answer" not in call:
        why = error or 'error: the JSON has no "answer" field'
        messages.append({"role": "user", "content": (
            f"{why}\nYou wrote:\n{reply.strip()}\n"
            'Reply again with only {"answer": <number>, "reason": "<one sentence>"}.'
        )})
        ask()
    return calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="which GSM8K-train questions")
    ap.add_argument("--gsm8k", type=Path, default=GSM8K_TRAIN, help="GSM8K-train questions")
    ap.add_argument("--out", type=Path, default=REPO / "data" / "agent_sessions.jsonl")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from jaxspec.build import build_engine
    from jaxspec.config import load_config

    rows = [json.loads(line) for line in args.gsm8k.read_text().splitlines() if line.strip()]
    picked = random.Random(args.seed).sample(range(len(rows)), args.sessions)
    engine = build_engine(load_config(REPO / "configs" / "smollm2-135m.yaml"))
    with args.out.open("w") as f:
        for n, i in enumerate(picked):
            calls = session(engine, engine.model.tokenizer, rows[i]["question"])
            reference = rows[i]["answer"].rsplit("####", 1)[-1].strip()
            line = {"id": f"agent-{n:02d}", "source": f"gsm8k_train.jsonl:{i}",
                    "reference_answer": reference, "calls": calls}
            f.write(json.dumps(line) + "\n")
            f.flush()
            print(f"session {n}: {len(calls)} calls", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
