#!/usr/bin/env bash
# The test command: sets up .venv on a fresh machine (scripts/bootstrap.sh), then runs the whole
# suite (unit, distributed gloo, real Megatron-Core schedules). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q "$@"
