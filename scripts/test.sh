#!/usr/bin/env bash
# Set up the environment, then run the whole test suite; exits with pytest's status.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# The suite compiles many hundreds of XLA programs in one process; each maps memory, and past the
# default vm.max_map_count (65530) XLA:CPU segfaulted mid-suite. Raise it where we may (root),
# and tests/conftest.py also drops compiled programs after every module.
if [ "$(cat /proc/sys/vm/max_map_count 2>/dev/null || echo 0)" -lt 262144 ]; then
  sysctl -qw vm.max_map_count=262144 2>/dev/null || true
fi
# shellcheck disable=SC1091
. .venv/bin/activate
# Two worker processes, whole files per worker (module fixtures stay shared): most of the suite's
# time is XLA compilation, which is single-threaded, so the second core halves the wall time.
# JAXSPEC_TEST_WORKERS=0 runs each phase in this one process.
workers="${JAXSPEC_TEST_WORKERS:-$(python -c 'import os; print(min(2, len(os.sched_getaffinity(0))))')}"
run() {
  if [ "$workers" -gt 1 ]; then
    python -m pytest -q -n "$workers" --dist loadfile "$@"
  else
    python -m pytest -q "$@"
  fi
}
# Two parts (tests/conftest.py says why): every module but three with XLA:CPU's faster-compiling
# code generation (classic fusion emitters, LLVM level 0), and, at the same time in one more
# process, the modules that measure the compiled programs users run (HLO bytes and copies, greedy
# identity at a near-tie) compiled as users compile (XLA's defaults); its report follows.
production=(tests/test_greedy_identity.py tests/test_roofline.py tests/test_accelerator_path.py)
status=0
keep() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ] || status=$1; }  # 5: a filter left a part empty
log="$(mktemp)"
python -m pytest -q "${production[@]}" "$@" >"$log" 2>&1 &
production_pid=$!
JAXSPEC_TEST_FAST_CODEGEN=1 run tests "${production[@]/#/--ignore=}" "$@" || keep $?
wait "$production_pid" || keep $?
echo "--- ${production[*]} (default code generation):"
cat "$log"
rm -f "$log"
exit "$status"
