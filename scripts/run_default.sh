#!/usr/bin/env bash
# The main job: n-gram speculative decoding on the embedded default model (SmolLM2-135M-Instruct).
# Extra arguments are passed on, e.g. `bash scripts/run_default.sh --json sampling.temperature=0.7`.
# Progress (setup steps, model load, compilation) goes to stderr; the generated text to stdout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export JAXSPEC_PROGRESS="${JAXSPEC_PROGRESS:-1}"  # announce every wait, even when stderr is a log
echo "run: n-gram speculation on SmolLM2-135M-Instruct (the first run compiles for a few minutes;" \
  "later runs load the compiled programs from the cache)" >&2
python -m jaxspec.generate --config configs/smollm2-135m-ngram.yaml \
  --prompt "Explain speculative decoding in three short sentences." "$@"
