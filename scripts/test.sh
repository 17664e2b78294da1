#!/usr/bin/env bash
# Set up the environment, then run the whole test suite; exits with pytest's status.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pytest -q tests "$@"
