#!/usr/bin/env bash
# Session 13 benchmark queue (issues 31, 26): one run at a time, each a same-run comparison
# against plain decoding of the same loaded target. Outputs under bench_out/ (untracked).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-/work/main/.venv/bin/python}
export PYTHONPATH=$PWD
b() { name=$1; shift; "$py" -m jaxspec.bench "$@" --no-plots --out bench_out/$name > bench_out/$name.log 2>&1; }
# issue 31: Gemma 3 270M, plain vs transformers, n-gram and adaptive n-gram vs plain
b gemma --config configs/gemma3-270m.yaml configs/gemma3-270m-ngram.yaml \
  configs/gemma3-270m-ngram-adaptive.yaml --peers hf --n-per-category 3 --max-new-tokens 128
# issue 26: block drafter (chain, tree) vs EAGLE (chain, tree)
b block --config configs/smollm2-135m-block.yaml configs/smollm2-135m-block-tree.yaml \
  configs/smollm2-135m-eagle.yaml configs/smollm2-135m-eagle-tree.yaml --n-per-category 3 --max-new-tokens 128
# issue 26: suffix + adaptive by category
b suffix --config configs/smollm2-135m-suffix-adaptive.yaml configs/smollm2-135m-suffix.yaml \
  --n-per-category 3 --max-new-tokens 128
# issue 26: the agent workload
b agent --workload agent --config configs/smollm2-135m-ngram.yaml configs/smollm2-135m-suffix.yaml \
  configs/smollm2-135m-suffix-eagle.yaml configs/smollm2-135m-block.yaml configs/smollm2-135m-eagle.yaml
