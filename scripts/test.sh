#!/usr/bin/env bash
# The test command: sets up .venv on a fresh machine (scripts/bootstrap.sh), checks lint and format
# (ruff, black; settings in pyproject.toml), then runs the whole suite (unit, distributed gloo, real
# Megatron-Core schedules). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check --quiet . || { echo "lint failed: run .venv/bin/ruff check --fix ." >&2; exit 1; }
.venv/bin/black --check --quiet . || { echo "format drift: run .venv/bin/black ." >&2; exit 1; }
exec .venv/bin/python -m pytest -q "$@"
