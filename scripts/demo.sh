#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv (scripts/bootstrap.sh), then train a small GPT with
# Megatron-LM's pretrain(), dynamic batching vs fixed micro-batches on the same samples
# (launch/demo.sh). Extra arguments go to both training runs (e.g. --train-iters 6).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec bash launch/demo.sh "$@"
