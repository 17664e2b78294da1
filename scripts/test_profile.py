"""Where the test suite's time goes, per module and per test: sums the per-process files a
profiled run writes into tests/timings.json, from which scripts/docs.py writes the table in
docs/testing.md; --write-order rewrites tests/suite_plan.py's LONGEST_FIRST from the same run.

    JAXSPEC_TEST_COMPILE_STATS=/tmp/stats bash scripts/test.sh --cold
    python scripts/test_profile.py /tmp/stats --run "session N, cold, 2-core machine" \\
        [--save tests/timings.json] [--write-order]
    python scripts/docs.py      # the table in docs/testing.md, from tests/timings.json

A profile of part of the suite (some files) updates those modules' rows only, each row saying
which run measured it. Each row: the module, what it proves (the first sentence of its
docstring), its wall seconds (setup + call + teardown of its tests, in the process that ran them;
the two xdist workers and the production process run side by side, so the sum exceeds the
suite's wall time), its tests, its three slowest tests, the programs it lowered and compiled (XLA
seconds), and the persistent XLA cache's hits and misses. tests/test_docs.py fails when a test
module has no row; a module not profiled yet has a row of dashes (run "not profiled") until a
profiled run measures it.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = ROOT / "tests" / "timings.json"
SLOWEST = 3  # tests named per module


def merged(stats_dir: Path) -> dict[str, dict[str, list[float]]]:
    """{module: {field: [seconds, count]}} summed over every process's file."""
    out: dict[str, dict[str, list[float]]] = {}
    for path in sorted(stats_dir.glob("*.json")):
        for module, fields in json.loads(path.read_text()).items():
            row = out.setdefault(module, {})
            for name, (seconds, count) in fields.items():
                total = row.setdefault(name, [0.0, 0])
                total[0] += seconds
                total[1] += count
    return out


def summary(fields: dict[str, list[float]], run: str) -> dict:
    """One module's row of tests/timings.json from its summed fields."""
    get = lambda name: fields.get(name, [0.0, 0])  # noqa: E731
    tests = sorted(((k[5:], v[0]) for k, v in fields.items() if k.startswith("test:")),
                   key=lambda kv: -kv[1])
    return {"run": run, "wall": round(get("wall")[0], 1), "tests": int(get("wall")[1]),
            "slowest": [[name, round(s, 1)] for name, s in tests[:SLOWEST]],
            "lowered": int(get("jaxpr_to_mlir_module_duration")[1]),
            "compiled": int(get("backend_compile_duration")[1]),
            "compile_s": round(get("backend_compile_duration")[0], 1),
            "hits": int(get("cache_hits")[1]), "misses": int(get("cache_misses")[1])}


def proves(module: str) -> str:
    """The first sentence of the test module's docstring (what it proves)."""
    path = ROOT / "tests" / module
    if not path.is_file():
        return ""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split())
    match = re.match(r"(.+?[.:;])(\s|$)", first)
    return (match.group(1) if match else first)[:160].replace("|", "\\|")


def table(timings: dict) -> str:
    """docs/testing.md's table: every module of tests/timings.json, longest first, then the runs
    its rows come from."""
    rows = sorted(timings["modules"].items(), key=lambda mf: -(mf[1]["wall"] or 0))
    lines = ["| module | what it proves | wall s | tests | slowest tests (s) | lowered "
             "| compiled (s) | cache hits / misses | run |",
             "|---|---|---:|---:|---|---:|---:|---:|---|"]
    for module, r in rows:
        slow = ", ".join(f"`{name}` {s:.0f}" for name, s in r["slowest"]) or "—"
        compiled = "—" if r["compiled"] is None else f"{r['compiled']} ({r['compile_s']:.0f})"
        cache = "—" if r["hits"] is None else f"{r['hits']} / {r['misses']}"
        lowered = "—" if r["lowered"] is None else r["lowered"]
        wall = "—" if r["wall"] is None else f"{r['wall']:.0f}"
        lines.append(f"| {module} | {proves(module)} | {wall} | {r['tests'] or '—'} | {slow} "
                     f"| {lowered} | {compiled} | {cache} | {r['run']} |")
    total = lambda key: sum(r[key] or 0 for _, r in rows)  # noqa: E731  (— counts 0)
    lines.append(f"| **all** | | {total('wall'):.0f} | {total('tests')} | | {total('lowered')} "
                 f"| {total('compiled')} ({total('compile_s'):.0f}) "
                 f"| {total('hits')} / {total('misses')} | |")
    lines.append("")
    lines += [f"- **{label}**: {text}" for label, text in sorted(timings["runs"].items())]
    return "\n".join(lines)


def save(stats: dict[str, dict[str, list[float]]], run: str, description: str, path: Path) -> None:
    """Update path's rows of the modules this run measured (the others keep theirs)."""
    timings = json.loads(path.read_text()) if path.is_file() else {"runs": {}, "modules": {}}
    for module, fields in stats.items():
        if module.startswith("test_"):
            timings["modules"][module] = summary(fields, run)
    timings["runs"][run] = description
    used = {r["run"] for r in timings["modules"].values()}
    timings["runs"] = {k: v for k, v in timings["runs"].items() if k in used}
    timings["modules"] = dict(sorted(timings["modules"].items()))
    path.write_text(json.dumps(timings, indent=1, ensure_ascii=False) + "\n")


def write_order(stats: dict[str, dict[str, list[float]]]) -> None:
    order = [m for m, f in sorted(stats.items(), key=lambda mf: -mf[1].get("wall", [0, 0])[0])
             if m.startswith("test_")]
    plan = ROOT / "tests" / "suite_plan.py"
    text = plan.read_text()
    body = "".join(f'    "{m}",\n' for m in order)
    # the assignment: "= ()" or "= (" + one quoted name per line + ")", nothing after it
    new, n = re.subn(r'LONGEST_FIRST: tuple\[str, \.\.\.\] = \((?:\)|\n(?:    "[^"\n]*",\n)*\))\n',
                     f"LONGEST_FIRST: tuple[str, ...] = (\n{body})\n", text, count=1)
    if n != 1:
        sys.exit("error: no LONGEST_FIRST assignment found in tests/suite_plan.py")
    plan.write_text(new)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stats_dir", type=Path, help="the JAXSPEC_TEST_COMPILE_STATS directory")
    p.add_argument("--run", default="last run",
                   help="what this run was (date, cold or warm, machine): a short label, then "
                        "': ' and a description, or a label alone")
    p.add_argument("--save", type=Path, nargs="?", const=TIMINGS, default=None,
                   help=f"update this timings file (default {TIMINGS.relative_to(ROOT)})")
    p.add_argument("--write-order", action="store_true",
                   help="rewrite tests/suite_plan.py's LONGEST_FIRST, longest module first")
    args = p.parse_args(argv)
    if not args.stats_dir.is_dir() or not list(args.stats_dir.glob("*.json")):
        print(f"error: no per-process files in {args.stats_dir}: run the suite with "
              "JAXSPEC_TEST_COMPILE_STATS set to it", file=sys.stderr)
        return 2
    stats = merged(args.stats_dir)
    label, _, description = args.run.partition(": ")
    modules = {m: summary(f, label) for m, f in stats.items() if m.startswith("test_")}
    print(table({"modules": modules, "runs": {label: description or label}}))
    if args.save:
        save(stats, label, description or label, args.save)
    if args.write_order:
        write_order(stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
