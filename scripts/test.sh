#!/usr/bin/env bash
# Set up the environment, then run the test suite, or the tests named; exits with pytest's status.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() {
  cat <<'EOF'
usage: bash scripts/test.sh [--quick] [--cold] [PYTEST_ARGS...]

Sets up .venv (scripts/setup.sh), then runs jaxspec's tests with pytest and exits with its status.

  bash scripts/test.sh                              the whole suite (what .ci/run runs)
  bash scripts/test.sh --quick                      one case per property (the inner loop, ~3 min)
  bash scripts/test.sh --cold                       ... with an empty XLA cache (the cold time)
  bash scripts/test.sh tests/test_cli.py            only these files / dirs / node ids
  bash scripts/test.sh tests/test_cli.py -k json    ... filtered with pytest's -k
  bash scripts/test.sh -k greedy -x                 the whole suite, with these pytest options

Files, directories and node ids (path::test) select what runs; every other argument is passed
to pytest as is. docs/testing.md says what each module proves and costs.

Compiled XLA programs are kept between runs in ~/.cache/jaxspec/test-xla (JAX's persistent cache,
keyed by jax/jaxlib, the program and the XLA flags; emptied when past 4 GB, no eviction):
a run after a change that leaves a program alone loads it; so are the CPU kernels and converted
tokenizers (~/.cache/jaxspec/test-kept, keyed by their sources). --cold uses empty ones, removed
at the end. Tests compile with XLA:CPU's faster code generation (JAXSPEC_TEST_FAST_CODEGEN=1) except
the modules that measure the compiled programs users run or depend on their last bit
(tests/suite_plan.py PRODUCTION_CODEGEN), which run in a second process, at the same time, with
XLA's defaults. Two pytest-xdist workers by default; JAXSPEC_TEST_WORKERS=0 runs each part in one
process. With CI=true a skip that is not listed in tests/suite_plan.py EXPECTED_SKIPS fails.
EOF
}
quick=0 cold=0 args=()
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    --quick) quick=1 ;;
    --cold) cold=1 ;;
    *) args+=("$arg") ;;
  esac
done
set -- ${args[@]+"${args[@]}"}

setup_started=$SECONDS
bash scripts/setup.sh test  # the full environment: the main job's packages plus the test extra
echo "test.sh: setup took $((SECONDS - setup_started)) s" >&2
# The suite compiles many hundreds of XLA programs in one process; each maps memory, and past the
# default vm.max_map_count (65530) XLA:CPU segfaulted mid-suite. Raise it where we may (root);
# tests/conftest.py drops compiled programs when a process nears the limit.
if [ "$(cat /proc/sys/vm/max_map_count 2>/dev/null || echo 0)" -lt 262144 ]; then
  sysctl -qw vm.max_map_count=262144 2>/dev/null || true
fi
# shellcheck disable=SC1091
. .venv/bin/activate

# The persistent XLA cache every test process and subprocess shares (they inherit the environment).
if [ -n "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  :  # the caller's
elif [ "$cold" -eq 1 ]; then
  JAX_COMPILATION_CACHE_DIR="$(mktemp -d -t jaxspec-test-xla-cold-XXXXXX)"
  export JAXSPEC_TEST_KEPT_CACHE="$JAX_COMPILATION_CACHE_DIR/kept"  # kernels, tokenizers
else
  JAX_COMPILATION_CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/jaxspec/test-xla"
  mkdir -p "$JAX_COMPILATION_CACHE_DIR"
fi
export JAX_COMPILATION_CACHE_DIR
# No eviction (-1): with a size limit JAX keeps an access-time file beside each entry, and a
# process interrupted between the two writes (the suite's Ctrl-C tests do that) left an entry
# without one, after which every process's every cache write failed. A kept cache past 4 GB is
# emptied here instead.
export JAX_COMPILATION_CACHE_MAX_SIZE=-1
if [ "$(du -sm "$JAX_COMPILATION_CACHE_DIR" | cut -f1)" -gt 4000 ]; then
  find "$JAX_COMPILATION_CACHE_DIR" -maxdepth 1 -type f -delete
fi
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
echo "test.sh: XLA cache $JAX_COMPILATION_CACHE_DIR ($(find "$JAX_COMPILATION_CACHE_DIR" -type f | wc -l) programs)" >&2

# The modules that measure the compiled programs users run compile as users compile (XLA's
# defaults): the list is tests/suite_plan.py's PRODUCTION_CODEGEN.
mapfile -t production < <(python -c 'import sys; sys.path.insert(0, "tests")
from suite_plan import PRODUCTION_CODEGEN
print("\n".join("tests/" + m for m in PRODUCTION_CODEGEN))')
is_production() {
  local p
  for p in "${production[@]}"; do [ "${1%%::*}" = "$p" ] && return 0; done
  return 1
}
# Split the arguments: paths (what to run) and pytest options (passed to both parts).
# -p no:langsmith_plugin: langchain's tracing plugin (installed with the test clients) costs
# ~1 s of imports in every pytest process and no test uses it.
fast=() slow=() opts=(-rs --durations=30 -p no:langsmith_plugin) named=0
[ "$quick" -eq 1 ] && opts+=(-m quick)
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then
    named=1
    if is_production "$arg"; then slow+=("$arg"); else fast+=("$arg"); fi
  else
    opts+=("$arg")
  fi
done
if [ "$named" -eq 0 ]; then  # the whole suite
  fast=(tests "${production[@]/#/--ignore=}")
  slow=("${production[@]}")
fi

# Two worker processes, whole files per worker (module fixtures stay shared): most of the suite's
# time is XLA compilation, which is single-threaded, so the second core halves the wall time.
workers="${JAXSPEC_TEST_WORKERS:-$(python -c 'import os; print(min(2, len(os.sched_getaffinity(0))))')}"
run() {
  if [ "$workers" -gt 1 ] && [ "$named" -eq 0 ]; then
    # --no-loadscope-reorder: xdist (>= 3.6) otherwise hands out files by their number of tests,
    # not in collection order, and tests/suite_plan.py's LONGEST_FIRST (the order conftest.py
    # collects in) would not reach the workers: files of few, long tests came last.
    python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
  else
    python -m pytest "$@"
  fi
}
status=0
keep() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ] || status=$1; }  # 5: a filter left a part empty
log="$(mktemp)"
trap 'rm -f "$log"; [ "$cold" -eq 1 ] && rm -rf "$JAX_COMPILATION_CACHE_DIR"; true' EXIT
started=$SECONDS
production_pid=
if [ "${#slow[@]}" -gt 0 ]; then
  python -m pytest "${slow[@]}" ${opts[@]+"${opts[@]}"} >"$log" 2>&1 &
  production_pid=$!
fi
if [ "${#fast[@]}" -gt 0 ]; then
  JAXSPEC_TEST_FAST_CODEGEN=1 run "${fast[@]}" ${opts[@]+"${opts[@]}"} || keep $?
fi
if [ -n "$production_pid" ]; then
  wait "$production_pid" || keep $?
  echo "--- ${slow[*]} (default code generation):"
  cat "$log"
fi
echo "test.sh: tests took $((SECONDS - started)) s (setup $((started - setup_started)) s before)" >&2
exit "$status"
