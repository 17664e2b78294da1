#!/usr/bin/env bash
# The main job: n-gram speculative decoding on the embedded default model (SmolLM2-135M-Instruct).
# Extra arguments are passed on, e.g. `bash scripts/run_default.sh --json sampling.temperature=0.7`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -m jaxspec.generate --config configs/smollm2-135m-ngram.yaml \
  --prompt "Explain speculative decoding in three short sentences." "$@"
