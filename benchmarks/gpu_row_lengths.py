"""Where a micro-batch's time jumps on a GPU: fixed ``[B x S]`` micro-batches around ``--seq-length``.

docs/gpu.md's H100 run planned rows of 2,111-2,360 tokens at ``--seq-length 2048`` and measured
each such micro-batch about 40% slower than a ``[3 x 2048]`` one, where the cost model (dense
attention: Megatron's local implementation) says +6-30%. This times the Megatron-LM entry
(``launch/train_gpt_dynbatch.sh``, fixed micro-batches, the GPU check's model and flags) at a few
``(--seq-length, --max-position-embeddings)`` pairs: if ``[3 x 2112]`` at ``--seq-length 2112``
costs about what S^2 growth says, the jump belongs to rows longer than the run's ``--seq-length``,
not to the row length itself.

    python3 benchmarks/gpu_row_lengths.py --wheels .whl      # one GPU, about 3 minutes
    python3 benchmarks/gpu_row_lengths.py --tiny             # CPU smoke run (a 2-layer model)

Prints one line per case: the median time per micro-batch over iterations 3+ and its ratio to the
first case, next to the cost model's ratio for dense attention (``t*S + 2*a*S^2`` with the H100
run's calibrated weights).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
from typing import List, Optional

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.gpu_check import (  # noqa: E402
    GPU_FLAGS,
    GPU_MODEL,
    TINY_MODEL,
    launch,
    make_corpus,
    prepare_environment,
)

#: (seq_length, max_position_embeddings) on a GPU: the run's rows, then rows just past 2,048 with
#: position embeddings long enough, one not a multiple of 8, and a longer one.
GPU_CASES = ((2048, 2048), (2112, 4096), (2111, 4096), (2304, 4096))
TINY_CASES = ((256, 256), (320, 512))
#: The H100 run's calibrated weights (docs/gpu.md): seconds per token and per squared token.
TOKEN_S, SQUARED_S = 1.722e-6, 0.5097e-9


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU: a 2-layer model in fp32")
    parser.add_argument("--wheels", type=pathlib.Path, help="megatron-core wheels to install")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/dynbatch-rows"))
    parser.add_argument("--micro-batch-size", type=int, default=3)
    parser.add_argument("--train-iters", type=int, default=8)
    options = parser.parse_args(argv)
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    prepare_environment(options.wheels, out)
    import torch

    gpu = torch.cuda.is_available() and not options.tiny
    model = dict(GPU_MODEL if gpu else TINY_MODEL)
    cases = GPU_CASES if gpu else TINY_CASES
    mbs, per_step = options.micro_batch_size, 4
    # Documents cut at the first case's length: every case's rows hold the same documents.
    data = make_corpus(out / "data", 2000, cases[0][0], seed=7)
    first_ms = None
    print(f"device: {torch.cuda.get_device_name(0) if gpu else 'cpu'}", flush=True)
    for seq, positions in cases:
        model.update({"--seq-length": str(seq), "--max-position-embeddings": str(positions)})
        args = [x for pair in model.items() for x in pair]
        args += ["--pipeline-model-parallel-size", "1", "--micro-batch-size", str(mbs)]
        args += ["--global-batch-size", str(mbs * per_step), "--eval-iters", "1"]
        args += ["--eval-interval", "1000", "--train-iters", str(options.train_iters)]
        args += (GPU_FLAGS + ["--bf16", "--lr", "3e-4", "--min-lr", "3e-5"]) if gpu else []
        name = f"fixed-{mbs}x{seq}-pos{positions}"
        try:
            run = launch(name, "fixed", args, data, out)
        except SystemExit as error:  # a case Megatron refuses: say so, go on
            print(f"{name}: failed ({error})", flush=True)
            continue
        times = [r["ms"] for i, r in run["parsed"]["iterations"].items() if i >= 3 and "ms" in r]
        per_mb = statistics.median(times) / per_step
        model_ms = 1e3 * mbs * (TOKEN_S * seq + 2 * SQUARED_S * seq * seq)
        if first_ms is None:
            first_ms, first_model = per_mb, model_ms
        print(
            f"[{mbs} x {seq}] --max-position-embeddings {positions}: {per_mb:.1f} ms a "
            f"micro-batch ({per_mb / first_ms:.3f}x; the cost model says "
            f"{model_ms / first_model:.3f}x), {len(times)} iterations",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
