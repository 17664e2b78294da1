"""The recorded vLLM comparisons of issue 45 as BENCHMARKS.md tables, read from their output
files (no vLLM or jax needed):

    python -m jaxspec.bench.vllm_tables serving OUT_DIR   # scripts/bench_vllm_serving.sh's dir
    python -m jaxspec.bench.vllm_tables gap FILE.jsonl    # the thread-gap probe's records

serving: one row per server x method x rate from OUT_DIR/runs.jsonl (jaxspec.bench.serve_http's
lines: label "jaxspec-ngram" / "vllm-ngram", ...), each with whether its completions equal
jaxspec plain's at that rate (greedy: speculation and the engine must not change a token), and
the start-up of each server x method from OUT_DIR/startup.jsonl, apart.
gap: the median ms/token of each engine per competing-load level, the CPU cores it held meanwhile
(its CPU seconds over wall seconds; x ms/token ~ the CPU time a token cost it), and the floor.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from jaxspec.errors import JaxspecError


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise JaxspecError(f"{path}: {e.strerror}: pass the file the run wrote") from None
    out = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                raise JaxspecError(f"{path}:{n}: not a JSON line: a truncated run? rerun it") from None
    return out


def serving_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (server, method, rate), the last run's figures and whether its texts equal jaxspec
    plain's at the same rate (None when there is no such run)."""
    last: dict[tuple[str, str, float], dict] = {}
    for r in runs:
        server, _, method = r["label"].partition("-")
        last[(server, method or "plain", float(r["rate"]))] = r
    rows = []
    for (server, method, rate), r in last.items():
        ref = last.get(("jaxspec", "plain", rate))
        same = None
        if ref is not None and "texts" in r and "texts" in ref:
            same = sum(a == b for a, b in zip(r["texts"], ref["texts"]))
        rows.append({"server": server, "method": method, "rate": rate,
                     "requests": r["requests"], "throughput_tok_s": r["throughput_tok_s"],
                     "ttft_p50_s": r["ttft_p50_s"], "ttft_p99_s": r["ttft_p99_s"],
                     "tpot_p50_ms": 1e3 * r["tpot_p50_s"], "tpot_p99_ms": 1e3 * r["tpot_p99_s"],
                     "same_as_jaxspec_plain": same})
    order = {"plain": 0, "ngram": 1, "suffix": 2}
    rows.sort(key=lambda x: (order.get(x["method"], 9), x["rate"], x["server"] != "jaxspec"))
    return rows


def serving_lines(runs: list[dict], startup: list[dict]) -> list[str]:
    lines = ["| method | rate req/s | server | throughput tok/s | TTFT p50 / p99 s "
             "| TPOT p50 / p99 ms | completions = jaxspec plain |", "|---|---|---|---|---|---|---|"]
    for r in serving_rows(runs):
        same = "–" if r["same_as_jaxspec_plain"] is None else \
            f"{r['same_as_jaxspec_plain']} / {r['requests']}"
        lines.append(f"| {r['method']} | {r['rate']:g} | {r['server']} | "
                     f"{r['throughput_tok_s']:.1f} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | "
                     f"{r['tpot_p50_ms']:.0f} / {r['tpot_p99_ms']:.0f} | {same} |")
    if startup:
        lines += ["", "Start-up (process start to /health answering; outside the window): " +
                  ", ".join(f"{s['server']} {s['method']} {s['startup_s']:.0f} s" for s in startup)]
    return lines


def gap_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over rounds and prompts per competing-load level (`busy` spinners)."""
    by: dict[tuple[int, str], list[dict]] = {}
    for r in records:
        if "busy" in r:
            by.setdefault((r["busy"], r["engine"]), []).append(r)
    rows = []
    for k in sorted({k for k, _ in by}):
        missing = [e for e in ("jaxspec", "vllm", "floor") if (k, e) not in by]
        if missing:
            raise JaxspecError(f"{k} spinners: no {missing[0]} records: a run cut short? rerun it")
        ms = {e: statistics.median(x["ms_per_token"] for x in by[(k, e)])
              for e in ("jaxspec", "vllm", "floor")}
        cores = {e: statistics.median(x["cpu_cores_used"] for x in by[(k, e)])
                 for e in ("jaxspec", "vllm")}
        floors = by.get((k, "floor"), [])
        rows.append({"busy": k, "jaxspec_ms": ms["jaxspec"], "vllm_ms": ms["vllm"],
                     "ratio": ms["jaxspec"] / ms["vllm"], "floor_ms": ms["floor"],
                     "jaxspec_cores": cores["jaxspec"], "vllm_cores": cores["vllm"],
                     "same_tokens": sum(bool(f.get("same_tokens")) for f in floors),
                     "pairs": len(floors),
                     "load1": statistics.median(x["load1"] for x in by[(k, "jaxspec")])})
    return rows


def gap_lines(records: list[dict]) -> list[str]:
    head = next((r for r in records if r.get("event") == "start"), {})
    lines = [f"CPUs {head.get('cpus')}, vLLM torch threads {head.get('vllm_torch_threads')}, "
             f"vLLM start-up {head.get('vllm_startup_s', 0):.0f} s (eager: {head.get('vllm_eager')})",
             "", "| spinners | load (1 min) | jaxspec ms/token | vLLM ms/token | jaxspec / vLLM "
             "| floor ms | CPU cores held, jaxspec / vLLM | CPU ms/token, jaxspec / vLLM | same tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in gap_rows(records):
        lines.append(f"| {r['busy']} | {r['load1']:.1f} | {r['jaxspec_ms']:.1f} | "
                     f"{r['vllm_ms']:.1f} | {r['ratio']:.2f} | {r['floor_ms']:.1f} | "
                     f"{r['jaxspec_cores']:.2f} / {r['vllm_cores']:.2f} | "
                     f"{r['jaxspec_cores'] * r['jaxspec_ms']:.0f} / "
                     f"{r['vllm_cores'] * r['vllm_ms']:.0f} | {r['same_tokens']} / {r['pairs']} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print("usage: python -m jaxspec.bench.vllm_tables {serving OUT_DIR | gap FILE.jsonl}\n")
        print(__doc__)
        return 0
    if len(argv) != 2 or argv[0] not in ("serving", "gap"):
        print("usage: python -m jaxspec.bench.vllm_tables {serving OUT_DIR | gap FILE.jsonl}",
              file=sys.stderr)
        return 2
    try:
        if argv[0] == "serving":
            d = Path(argv[1])
            start = d / "startup.jsonl"
            lines = serving_lines(read_jsonl(d / "runs.jsonl"),
                                  read_jsonl(start) if start.is_file() else [])
        else:
            lines = gap_lines(read_jsonl(Path(argv[1])))
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
