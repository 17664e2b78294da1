#!/usr/bin/env bash
# Set up the environment, then run the test suite, or the tests named; exits with pytest's status.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

usage() {
  cat <<'EOF'
usage: bash scripts/test.sh [PYTEST_ARGS...]

Sets up .venv (scripts/setup.sh), then runs jaxspec's tests with pytest and exits with its status.

  bash scripts/test.sh                              the whole suite (what .ci/run runs)
  bash scripts/test.sh tests/test_cli.py            only these files / dirs / node ids
  bash scripts/test.sh tests/test_cli.py -k json    ... filtered with pytest's -k
  bash scripts/test.sh -k greedy -x                 the whole suite, with these pytest options

Files, directories and node ids (path::test) select what runs; every other argument is passed
to pytest as is. Tests compile with XLA:CPU's faster code generation (JAXSPEC_TEST_FAST_CODEGEN=1)
except the modules that measure the compiled programs users run or depend on their last bit
(tests/test_greedy_identity.py, tests/test_roofline.py, tests/test_accelerator_path.py,
tests/test_tree_chain.py), which run in a second process, at the same time, with XLA's defaults. Two pytest-xdist workers by default; JAXSPEC_TEST_WORKERS=0 runs
each part in one process.
EOF
}
for arg in "$@"; do
  case "$arg" in -h|--help) usage; exit 0 ;; esac
done

bash scripts/setup.sh
# The suite compiles many hundreds of XLA programs in one process; each maps memory, and past the
# default vm.max_map_count (65530) XLA:CPU segfaulted mid-suite. Raise it where we may (root),
# and tests/conftest.py also drops compiled programs after every module.
if [ "$(cat /proc/sys/vm/max_map_count 2>/dev/null || echo 0)" -lt 262144 ]; then
  sysctl -qw vm.max_map_count=262144 2>/dev/null || true
fi
# shellcheck disable=SC1091
. .venv/bin/activate

# The modules that measure the compiled programs users run (HLO bytes and copies, greedy identity
# at a near-tie: tests/conftest.py says why) compile as users compile (XLA's defaults).
production=(tests/test_greedy_identity.py tests/test_roofline.py tests/test_accelerator_path.py
            tests/test_tree_chain.py)
is_production() {
  local p
  for p in "${production[@]}"; do [ "${1%%::*}" = "$p" ] && return 0; done
  return 1
}
# Split the arguments: paths (what to run) and pytest options (passed to both parts).
fast=() slow=() opts=() named=0
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
    python -m pytest -q -n "$workers" --dist loadfile "$@"
  else
    python -m pytest -q "$@"
  fi
}
status=0
keep() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ] || status=$1; }  # 5: a filter left a part empty
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
production_pid=
if [ "${#slow[@]}" -gt 0 ]; then
  python -m pytest -q "${slow[@]}" ${opts[@]+"${opts[@]}"} >"$log" 2>&1 &
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
exit "$status"
