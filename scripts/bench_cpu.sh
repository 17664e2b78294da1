#!/usr/bin/env bash
# The full CPU benchmark behind BENCHMARKS.md: every shipped config (configs whose method is not
# registered yet, or whose trained checkpoint is missing, are skipped and listed in the results),
# Spec-Bench dev questions, transformers peers, γ sweep of the n-gram drafter, batch sweep.
# Usage: bash scripts/bench_cpu.sh [OUT_DIR] [extra jaxspec.bench flags...]
# Runs unniced and alone: timings on a busy machine are not worth publishing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
out="${1:-bench_out/cpu}"
shift || true
configs=(configs/smollm2-135m.yaml configs/smollm2-135m-ngram.yaml
         configs/smollm2-135m-layerskip.yaml configs/smollm2-135m-draft.yaml
         configs/smollm2-135m-eagle.yaml configs/smollm2-135m-medusa.yaml)
# Two processes: one process compiling every program of both phases ran out of LLVM section
# memory (vm.max_map_count) on this machine.
python -m jaxspec.bench \
  --config "${configs[@]}" --skip-unavailable \
  --n-per-category 5 --max-new-tokens 128 \
  --peers hf \
  --out "$out" "$@"
python -m jaxspec.bench --sweeps-only \
  --config configs/smollm2-135m.yaml configs/smollm2-135m-ngram.yaml \
  --gammas 1,2,3,5,8 --sweep-config configs/smollm2-135m-ngram.yaml --sweep-prompts 6 \
  --batch-sizes 1,2,4,8,16,32 --batch-max-new-tokens 64 \
  --out "$out/sweeps" "$@"
