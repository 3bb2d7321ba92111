#!/bin/bash

# Trains a small GPT with Megatron-LM's pretrain() and megatron_dynbatch's dynamic batching, in the
# style of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh. Extra arguments are passed
# to launch/pretrain_gpt_dynbatch.py after the ones below (a repeated flag takes the last value).
#
#   DATA_PATH=data/pydoc_text_document bash launch/train_gpt_dynbatch.sh        # dynamic batching
#   BATCHING=fixed bash launch/train_gpt_dynbatch.sh                            # fixed baseline
#   bash launch/train_gpt_dynbatch.sh --train-iters 50 --max-tokens-per-gpu 512
#   BATCHING=stock bash launch/train_gpt_dynbatch.sh --dataloader-inter-document-masking
#
# The core attention, in every BATCHING mode: --dynamic-batch-attention auto (default:
# transformer-engine with --transformer-impl transformer_engine, torch-varlen on CUDA in bf16,
# else Megatron's local attention, with the reference on THD rows), transformer-engine,
# torch-varlen (torch's flash kernels; CUDA) or reference (dense torch, any device).
#
# Environment (all optional): GPUS_PER_NODE (default: the GPUs nvidia-smi lists, else 2 CPU
# processes), NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (the rendezvous; on one node without
# MASTER_PORT torchrun --standalone picks a free port, so a busy 6000 is no problem), DATA_PATH (an
# indexed-dataset prefix, or a JSONL of conversations with --sft; mock data when empty), BATCHING
# (dynamic | fixed | stock), MAX_TOKENS_PER_GPU, TORCHRUN. Without CUDA the same command runs on
# CPU with gloo (see docs/cpu.md).

set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

if [[ -z ${GPUS_PER_NODE:-} ]]; then
    GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [[ $GPUS_PER_NODE -gt 0 ]] || GPUS_PER_NODE=2
fi
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-}
DATA_PATH=${DATA_PATH:-}
BATCHING=${BATCHING:-dynamic}
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-256}
TORCHRUN=${TORCHRUN:-torchrun}

DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE")
if [[ $NUM_NODES == 1 && -z $MASTER_PORT ]]; then
    # One node and no port asked for: a rendezvous on a free port (a fixed 6000 failed with
    # EADDRINUSE whenever another job held it).
    DISTRIBUTED_ARGS+=(--standalone)
else
    DISTRIBUTED_ARGS+=(
        --nnodes "$NUM_NODES"
        --node_rank "$NODE_RANK"
        --master_addr "$MASTER_ADDR"
        --master_port "${MASTER_PORT:-6000}"
    )
fi

GPT_MODEL_ARGS=(
    --num-layers 4
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 256
    --max-position-embeddings 256
    --position-embedding-type rope
)

TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 32
    --train-iters 20
    --lr 1.0e-3
    --min-lr 1.0e-4
    --lr-decay-style cosine
    --lr-warmup-fraction 0.1  # 2 of 20 iterations; a fraction, so --train-iters 2 runs too
    --weight-decay 0.01
    --clip-grad 1.0
    --hidden-dropout 0.0
    --attention-dropout 0.0
    --calculate-per-token-loss
    --seed 1234
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
)

if [[ -n $DATA_PATH ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 98,2,0)
else
    DATA_ARGS=(--mock-data)
fi
# Byte-level tokens (python -m megatron_dynbatch.integrations.megatron_lm.data.preprocess): 256 bytes + end of document.
DATA_ARGS+=(--tokenizer-type NullTokenizer --vocab-size 257)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --eval-interval 10
    --eval-iters 2
)

case $BATCHING in
    dynamic) BATCHING_ARGS=(--use-dynamic-batch-size --max-tokens-per-gpu "$MAX_TOKENS_PER_GPU") ;;
    fixed) BATCHING_ARGS=(--document-samples) ;;
    stock) BATCHING_ARGS=() ;;
    *) echo "error: BATCHING=$BATCHING; use dynamic, fixed or stock." >&2; exit 2 ;;
esac

exec "$TORCHRUN" "${DISTRIBUTED_ARGS[@]}" "$HERE/pretrain_gpt_dynbatch.py" \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${BATCHING_ARGS[@]}" \
    "$@"
