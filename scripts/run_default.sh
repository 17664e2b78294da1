#!/usr/bin/env bash
# The main job: n-gram speculative decoding on the embedded default model (SmolLM2-135M-Instruct).
# Extra arguments are passed on, e.g. `bash scripts/run_default.sh --json sampling.temperature=0.7`.
# Sets up .venv for the main job only (scripts/setup.sh main: no torch, no test clients).
# Progress (setup steps, model load, compilation) goes to stderr; the generated text to stdout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh main
echo "run: n-gram speculation on SmolLM2-135M-Instruct (a fresh cache compiles two programs," \
  "30-90 s on a 2-core CPU; later runs load them from the cache)" >&2
exec .venv/bin/python -m jaxspec.generate --config configs/smollm2-135m-ngram.yaml \
  --prompt "Explain speculative decoding in three short sentences." "$@"
