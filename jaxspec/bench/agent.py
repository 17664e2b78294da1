"""The agent workload (`python -m jaxspec.bench --workload agent`): multi-turn tool-calling sessions
(data/agent_sessions.jsonl, made by scripts/make_agent_workload.py) run like Spec-Bench.

    python -m jaxspec.bench --workload agent --config configs/smollm2-135m-ngram.yaml \\
        configs/smollm2-135m-suffix.yaml --max-new-tokens 96 --out bench_agent

Protocol: every call of every session, sessions in order and calls in order, each rendered with
the target's chat template (the whole conversation so far: system prompt with the tool schema,
earlier tool calls and results), greedy, batch 1, through ONE engine per config, so a drafter that
learns from finished requests (suffix decoding's store) has seen the earlier calls, as an agent
serving loop would. Methods interleave per call (baseline, A, B, ... for call 1, then call 2),
warm-up excluded, every method's tokens checked against the baseline's. Figures: overall and by
call index within a session (call 1 sees only earlier sessions; later calls repeat their own).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxspec.bench.facts import json_default, machine_facts
from jaxspec.bench.spec_bench import Bench
from jaxspec.bench.plan import plan_bench
from jaxspec.bench.rows import aggregate, drop_ids, summarise_configs
from jaxspec.errors import JaxspecError




def read_sessions(path: str | Path) -> list[dict[str, Any]]:
    """The sessions file -> one prompt per call, in session order: {question_id, category
    ("call <k>"), messages, prefix (the forced start of the reply, "" if none)}."""
    path = Path(path)
    if not path.is_file():
        raise JaxspecError(f"--agent-data {path}: no such file (make it with "
                           "scripts/make_agent_workload.py)")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            session = json.loads(line)
            calls = session["calls"]
            for k, call in enumerate(calls, 1):
                messages = call["messages"]
                if not (isinstance(messages, list) and all("role" in m and "content" in m
                                                           for m in messages)):
                    raise KeyError("messages")
                prefix = call.get("prefix", "")
                if not isinstance(prefix, str):
                    raise TypeError("prefix must be a string")
                prompts.append({"question_id": f"{session['id']}/{k}", "category": f"call {k}",
                                "messages": messages, "prefix": prefix,
                                "prompt": messages[-1]["content"]})
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise JaxspecError(
                f"{path} line {n}: not a session ({type(e).__name__}: {e}); expected "
                '{"id", "calls": [{"messages": [{"role", "content"}, ...]}, ...]}'
            ) from None
    if not prompts:
        raise JaxspecError(f"--agent-data {path}: no sessions")
    return prompts


def prompt_ids(tokenizer, messages: list[dict], prefix: str = "") -> list[int]:
    """A call's prompt: the conversation in the chat template with the assistant turn opened, then
    the forced start of its reply (`prefix`: a forced tool call), as the sessions were made."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
    return [int(t) for t in ids] + tokenizer.encode(prefix, add_special_tokens=False)


class AgentBench(Bench):
    """Bench with the agent sessions as prompts (chat-rendered token ids) and its own summary."""

    def prepare(self) -> None:
        if self.args.gammas or self.args.batch_sizes or self.args.peers != "none":
            raise JaxspecError("--workload agent runs the main protocol only: drop --gammas, "
                               "--batch-sizes and --peers")
        prompts = read_sessions(self.args.agent_data)
        self.plan = plan_bench(self.args, prompts)
        self.results["settings"] = {
            "workload": "agent",
            "data": str(self.args.agent_data),
            "num_calls": len(prompts),
            "num_sessions": len({p["question_id"].split("/")[0] for p in prompts}),
            "max_new_tokens": self.args.max_new_tokens,
            "sampling": "greedy",
            "batch_size": 1,
            "order": "sessions in order, calls in order, one engine per config",
            "warm_up": "one untimed run per engine per prompt-length bucket",
            "baseline": "plain decoding of the same loaded target",
            "configs": dict(self.plan.config_paths),
            "config_values": {l: c.to_dict() for l, c in self.plan.configs.items()},
        }
        self.results["machine"] = machine_facts()
        self._note_skipped()

    def load(self) -> None:
        super().load()
        tok = self.engines["baseline"].model.tokenizer
        if tok is None:
            raise JaxspecError("--workload agent needs the model's tokenizer (chat template)")
        self.ids = []
        for p in self.prompts:
            self.ids.append(prompt_ids(tok, p["messages"], p["prefix"]))

    def summarise(self) -> None:
        summary = summarise_configs(self.configs, self.plan.config_paths, self.rows)
        if not summary:
            return
        self.results.update(summary)
        base = self.rows["baseline"]
        calls = sorted({r["category"] for r in base}, key=lambda c: int(c.split()[-1]))
        by_call = {}
        for label, rows in self.rows.items():
            if label == "baseline":
                continue
            gamma = self.configs[label].speculative.num_speculative_tokens
            by_call[label] = {
                c: aggregate([r for r in rows if r["category"] == c],
                             [r for r in base[: len(rows)] if r["category"] == c], gamma)
                for c in calls
            }
        self.results["by_call"] = by_call

    def write(self, plots: bool) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.results["per_prompt"] = {
            n: [drop_ids(r) for r in rows] for n, rows in self.rows.items()
        }
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, default=json_default) + "\n")
        tmp.replace(self.out / "results.json")
        if plots:
            (self.out / "summary.md").write_text(summary_markdown(self.results))


def summary_markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [
        f"# Agent workload: {s['num_sessions']} sessions, {s['num_calls']} calls, "
        f"greedy, ≤ {s['max_new_tokens']} new tokens",
        "",
        f"`{results['command']}`",
        "",
        "| config | speedup | e2e speedup | mean accepted length | step cost | outputs = plain |",
        "|---|---|---|---|---|---|",
    ]
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for label, c in results.get("configs", {}).items():
        o = c.get("overall", {}) if isinstance(c, dict) else {}
        if not o:
            continue
        lines.append(
            f"| {label} | {fmt(o.get('speedup'))}x | {fmt(o.get('e2e_speedup'))}x | "
            f"{fmt(o.get('mean_accepted_length'))} | {fmt(o.get('step_cost_ratio'))} | "
            f"{o.get('outputs_match_baseline')} |"
        )
    by_call = results.get("by_call", {})
    if by_call:
        calls = list(next(iter(by_call.values())))
        lines += ["", "Speedup by call index (mean accepted length):", "",
                  "| config | " + " | ".join(calls) + " |", "|---" * (len(calls) + 1) + "|"]
        for label, per in by_call.items():
            cells = [f"{fmt(per[c]['speedup'])}x ({fmt(per[c]['mean_accepted_length'])})"
                     for c in calls]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
