#!/usr/bin/env bash
# No-regression check between two source trees: the same Spec-Bench run (plain, ngram, eagle)
# from each tree in turn, ABBA order so a drift of the shared machine's speed cancels out.
# usage: scripts/bench_noregress.sh BEFORE_TREE AFTER_TREE OUT_DIR [N_PER_CAT] [MAX_NEW]
set -euo pipefail
before=$1; after=$2; out=$(realpath -m "$3"); n=${4:-3}; m=${5:-128}
py=${PYTHON:-python}
data=$(cd "$(dirname "$0")/.." && pwd)/data/spec_bench_dev.jsonl
mkdir -p "$out"
run() {  # tree label
  (cd "$1" && PYTHONPATH="$1" "$py" -m jaxspec.bench \
     --config configs/smollm2-135m.yaml configs/smollm2-135m-ngram.yaml configs/smollm2-135m-eagle.yaml \
     --data "$data" --n-per-category "$n" --max-new-tokens "$m" --no-plots --out "$out/$2" > "$out/$2.log" 2>&1)
}
run "$before" before1; run "$after" after1; run "$after" after2; run "$before" before2
