"""Where the test suite's time goes, per module: sums the per-process files a profiled run writes
and prints the table docs/testing.md holds; --write-order rewrites tests/suite_plan.py's
LONGEST_FIRST from it.

    JAXSPEC_TEST_COMPILE_STATS=/tmp/stats bash scripts/test.sh --cold
    python scripts/test_profile.py /tmp/stats [--write-order]

Each row: the module, what it proves (the first sentence of its docstring), its wall seconds
(setup + call + teardown of its tests, in the process that ran them; the two xdist workers and
the production process run side by side, so the sum exceeds the suite's wall time), its tests,
the programs it lowered and compiled, and the persistent XLA cache's hits and misses.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("wall", "jaxpr_to_mlir_module_duration", "backend_compile_duration", "cache_hits",
          "cache_misses")


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


def proves(module: str) -> str:
    """The first sentence of the test module's docstring (what it proves)."""
    path = ROOT / "tests" / module
    if not path.is_file():
        return ""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split())
    match = re.match(r"(.+?[.:;])(\s|$)", first)
    return (match.group(1) if match else first)[:160]


def table(stats: dict[str, dict[str, list[float]]]) -> str:
    rows = sorted(((m, f) for m, f in stats.items() if m.startswith("test_")),
                  key=lambda mf: -mf[1].get("wall", [0, 0])[0])
    lines = ["| module | what it proves | wall s | tests | lowered | compiled (s) | cache hits / misses |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for module, f in rows:
        get = lambda name: f.get(name, [0.0, 0])  # noqa: E731
        lines.append(
            f"| {module} | {proves(module)} | {get('wall')[0]:.0f} | {get('wall')[1]} "
            f"| {get('jaxpr_to_mlir_module_duration')[1]} "
            f"| {get('backend_compile_duration')[1]} ({get('backend_compile_duration')[0]:.0f}) "
            f"| {get('cache_hits')[1]} / {get('cache_misses')[1]} |")
    total = lambda name, i: sum(f.get(name, [0.0, 0])[i] for _, f in rows)  # noqa: E731
    lines.append(f"| **all** | | {total('wall', 0):.0f} | {total('wall', 1)} "
                 f"| {total('jaxpr_to_mlir_module_duration', 1)} "
                 f"| {total('backend_compile_duration', 1)} "
                 f"({total('backend_compile_duration', 0):.0f}) "
                 f"| {total('cache_hits', 1)} / {total('cache_misses', 1)} |")
    return "\n".join(lines)


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
    p.add_argument("--write-order", action="store_true",
                   help="rewrite tests/suite_plan.py's LONGEST_FIRST, longest module first")
    args = p.parse_args(argv)
    if not args.stats_dir.is_dir() or not list(args.stats_dir.glob("*.json")):
        print(f"error: no per-process files in {args.stats_dir}: run the suite with "
              "JAXSPEC_TEST_COMPILE_STATS set to it", file=sys.stderr)
        return 2
    stats = merged(args.stats_dir)
    print(table(stats))
    if args.write_order:
        write_order(stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
