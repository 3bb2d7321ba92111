#!/usr/bin/env bash
# The main job, in an environment set up by scripts/bootstrap.sh: Megatron-LM's pretrain() through
# launch/train_gpt_dynbatch.sh on the bundled corpus (Python's documentation, built into
# $DATA_DIR/pydoc_text_document.{bin,idx} on first use, default data/), once with dynamic batching and
# once with Megatron's fixed micro-batches on the same samples, then the comparison
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

for batching in dynamic fixed; do
  echo
  echo "=== $batching micro-batches (BATCHING=$batching bash launch/train_gpt_dynbatch.sh) ==="
  if ! BATCHING=$batching DATA_PATH=$DATA_PREFIX bash launch/train_gpt_dynbatch.sh "$@" \
      >"$OUT/$batching.log" 2>&1; then
    tail -n 40 "$OUT/$batching.log" >&2
    echo "error: the $batching run failed; full log in $OUT/$batching.log" >&2
    exit 1
  fi
  grep -E "\] iteration +[0-9]+/|validation loss at iteration [0-9]+ \|" "$OUT/$batching.log" \
    | sed -E 's/^ *\[[^]]*\] //; s/ number of (skipped|nan) iterations: +[0-9]+ \|//g'
done

echo
exec "$PY" launch/compare_runs.py --dynamic "$OUT/dynamic.log" --fixed "$OUT/fixed.log" \
  --seq-length "$SEQ_LENGTH"
