#!/usr/bin/env bash
# Run the main job in an environment already set up (scripts/bootstrap.sh): a tiny Megatron GPT,
# pp=2 on CPU/gloo, dynamic batching vs fixed micro-batches. Extra arguments go to train_demo.py
# (e.g. --steps 4). On a GPU node: NPROC=8 bash launch/demo.sh --pipeline-model-parallel-size 2
# (torchrun picks NCCL via train_demo.py when CUDA is present); multi-node: set the usual torchrun
# rendezvous flags in TORCHRUN_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
NPROC=${NPROC:-2}
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" ${TORCHRUN_ARGS:-} \
  launch/train_demo.py --use-dynamic-batch-size "$@"
