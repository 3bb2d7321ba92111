#!/usr/bin/env bash
# The main job, in an environment set up by scripts/bootstrap.sh: Megatron-LM's pretrain() through
# launch/train_gpt_dynbatch.sh on the bundled corpus (Python's documentation, built into
# $DATA_DIR/pydoc_text_document.{bin,idx} on first use, default data/): Megatron's fixed [4 x 256]
# micro-batches first, then dynamic batching at the same memory in bytes (fixed's measured peak,
# the largest rank's, is the dynamic run's --max-memory-gib; its token budget, 4096, would
# otherwise allow far longer rows), a 256-token budget beside them, and (STOCK=1, default; empty to
# skip) Megatron's own packing of --seq-length windows, as many tokens a step as the dynamic run
# trained, then the comparisons
# (launch/compare_runs.py). Megatron's iteration lines are printed; full logs go to $OUT (default
# out/demo/). Extra arguments go to both runs (e.g. --train-iters 6). On a GPU node the same script
# uses every GPU nvidia-smi lists (NCCL).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export TORCHRUN=${TORCHRUN:-"$(dirname "$PY")/torchrun"}
OUT=${OUT:-out/demo}
DATA_DIR=${DATA_DIR:-data}
DATA_PREFIX=$DATA_DIR/pydoc_text_document
SEQ_LENGTH=256  # launch/train_gpt_dynbatch.sh's --seq-length
mkdir -p "$OUT"

if [[ ! -f $DATA_PREFIX.idx || ! -f $DATA_PREFIX.bin ]]; then
  "$PY" launch/make_pydoc_corpus.py "$DATA_DIR/pydoc.jsonl"
  "$PY" -m megatron_dynbatch.integrations.megatron_lm.data.preprocess --input "$DATA_DIR/pydoc.jsonl" \
    --output-prefix "$DATA_DIR/pydoc" --append-eod
fi

# The headline compares equal memory, measured in bytes: fixed micro-batches are [4 x 256]
# (--micro-batch-size 4); the dynamic run gets their measured peak as --max-memory-gib and a token
# budget (MEMORY_TOKEN_BUDGET, default 4096) that the memory budget, not tokens, binds.
# SMALL_BUDGET (default 256 tokens, a quarter of fixed's; empty to skip) runs beside it.
EQUAL_BUDGET=1024
MEMORY_TOKEN_BUDGET=${MEMORY_TOKEN_BUDGET:-4096}
SMALL_BUDGET=${SMALL_BUDGET-256}

train() {  # name batching budget [args...]
  local name=$1 batching=$2 budget=$3
  shift 3
  echo
  echo "=== $name micro-batches (BATCHING=$batching MAX_TOKENS_PER_GPU=$budget bash launch/train_gpt_dynbatch.sh) ==="
  if ! BATCHING=$batching MAX_TOKENS_PER_GPU=$budget DATA_PATH=$DATA_PREFIX \
      bash launch/train_gpt_dynbatch.sh "$@" >"$OUT/$name.log" 2>&1; then
    tail -n 40 "$OUT/$name.log" >&2
    echo "error: the $name run failed; full log in $OUT/$name.log" >&2
    exit 1
  fi
  grep -E "\] iteration +[0-9]+/|validation loss at iteration [0-9]+ \|" "$OUT/$name.log" \
    | sed -E 's/^ *\[[^]]*\] //; s/ number of (skipped|nan) iterations: +[0-9]+ \|//g'
}

peak() {  # the largest rank's measured training peak (MiB) in a log
  grep -oE "peak memory measured over training \(MiB\): [0-9.]+" "$1" | tail -n 1 | awk '{print $NF}'
}

train fixed fixed "$EQUAL_BUDGET" "$@"
FIXED_PEAK=$(peak "$OUT/fixed.log")
MEMORY_GIB=$(awk -v mib="$FIXED_PEAK" 'BEGIN { printf "%.6f", mib / 1024 }')
train dynamic dynamic "$MEMORY_TOKEN_BUDGET" --max-memory-gib "$MEMORY_GIB" "$@"
if [[ -n $SMALL_BUDGET ]]; then
  train "dynamic-$SMALL_BUDGET" dynamic "$SMALL_BUDGET" "$@"
fi
STOCK=${STOCK-1}
STOCK_ARGS=()
if [[ -n $STOCK ]]; then
  # Stock packing trains --global-batch-size windows of $SEQ_LENGTH tokens a step: as many as hold
  # the dynamic run's mean real tokens a step (a multiple of micro-batch size x data-parallel
  # size, from Megatron's argument dump), so what is fixed per optimizer step (the optimizer,
  # the gradient reduction, the pipeline's fill and drain) weighs the same in both, as for a user
  # who sizes a step in tokens (benchmarks/gpu_check.py does the same on a GPU).
  STOCK_WINDOWS=$(awk -v seq="$SEQ_LENGTH" '
    /^ +micro_batch_size \.+ [0-9]+$/ { mbs = $NF }
    /^ +data_parallel_size \.+ [0-9]+$/ { dp = $NF }
    match($0, /real tokens: [0-9]+/) { split(substr($0, RSTART, RLENGTH), f, ": "); sum += f[2]; n++ }
    END { m = mbs * dp; w = m * int(sum / n / seq / m + 0.5); print (w < m ? m : w) }
  ' "$OUT/dynamic.log")
  echo
  echo "stock packing: $STOCK_WINDOWS windows of $SEQ_LENGTH a step (the dynamic run's real tokens a step)"
  train stock stock "$EQUAL_BUDGET" "$@" --global-batch-size "$STOCK_WINDOWS"
  STOCK_ARGS=(--stock "$OUT/stock.log")
fi

echo
echo "=== equal memory: dynamic under --max-memory-gib $MEMORY_GIB (fixed [4x$SEQ_LENGTH]'s measured peak) against fixed [4x$SEQ_LENGTH] ==="
status=0
"$PY" launch/compare_runs.py --dynamic "$OUT/dynamic.log" --fixed "$OUT/fixed.log" \
  --seq-length "$SEQ_LENGTH" "${STOCK_ARGS[@]}" || status=1
PEAKS="fixed $FIXED_PEAK, dynamic $(peak "$OUT/dynamic.log")"
if [[ -n $STOCK ]]; then
  PEAKS+=", stock $(peak "$OUT/stock.log")"  # its [4 x 256] windows: fixed's shape, no budget
fi
echo "peak memory measured over training (MiB, largest rank): $PEAKS"
if [[ -n $SMALL_BUDGET ]]; then
  echo
  echo "=== a quarter of the memory: dynamic budget $SMALL_BUDGET tokens against fixed [4x$SEQ_LENGTH] ==="
  "$PY" launch/compare_runs.py --dynamic "$OUT/dynamic-$SMALL_BUDGET.log" --fixed "$OUT/fixed.log" \
    --seq-length "$SEQ_LENGTH" || status=1
fi
exit $status
