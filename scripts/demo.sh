#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv (scripts/bootstrap.sh), then train the tiny
# Megatron GPT with and without dynamic batching (launch/demo.sh). Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec bash launch/demo.sh "$@"
