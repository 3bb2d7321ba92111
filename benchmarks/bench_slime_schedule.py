"""Planning time of the slime drop-in (``build_dp_schedule``, log-prob passes included).

CPU time (``time.process_time``) of one single-threaded call, the minimum of ``--repeats`` runs
(other load only ever adds time), on long-tailed GRPO lengths (groups of 8,
:func:`benchmarks.lengths.grpo_lengths`), one optimizer step of every rollout, ``max_tokens_per_gpu``
16,384, tp 1, pp 4, vpp 2 (group 4), slime's default padding (tp x 128) and variable rows:

* ``16k/dp64``: 16,384 samples at dp 64 (goal 0.15 s);
* ``1M/dp512``: 1,048,576 samples at dp 512 (goal 5 s).

Run: ``.venv/bin/python -m benchmarks.bench_slime_schedule [--repeats 3] [--only NAME]``.
"""

from __future__ import annotations

import argparse
import os
import time
import types
from typing import Dict, List, Optional, Tuple

from benchmarks.lengths import grpo_lengths
from megatron_dynbatch.adapters.slime import build_dp_schedule

__all__ = ["WORKLOADS", "measure"]

GROUP_SIZE = 8
TOKEN_CAP = 16384
#: name -> (samples, dp_size, goal in CPU seconds).
WORKLOADS: Dict[str, Tuple[int, int, float]] = {
    "16k/dp64": (16384, 64, 0.15),
    "1M/dp512": (1 << 20, 512, 5.0),
}


def _args() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=TOKEN_CAP,
        micro_batch_size=1,
        balance_data=False,
        balance_by_flops=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=4,
        data_pad_size_multiplier=128,
    )


def measure(name: str, repeats: int = 3) -> float:
    """The fewest CPU seconds of ``repeats`` calls on workload ``name``."""
    num_samples, dp, _ = WORKLOADS[name]
    samples = grpo_lengths(num_samples // GROUP_SIZE, GROUP_SIZE, max_len=TOKEN_CAP, seed=0)
    lengths, ids = list(samples.lengths), list(samples.rollout_ids)
    layout = {"dp_size": dp, "cp_size": 1, "vpp_size": 2, "microbatch_group_size_per_vp_stage": 4}
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        build_dp_schedule(
            _args(),
            layout,
            lengths,
            global_batch_size=num_samples // GROUP_SIZE,
            rollout_indices=ids,
        )
        best = min(best, time.process_time() - start)
    return best


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (min reported)")
    parser.add_argument("--only", choices=sorted(WORKLOADS), help="one workload")
    options = parser.parse_args(argv)
    for name in [options.only] if options.only else list(WORKLOADS):
        seconds = measure(name, options.repeats)
        goal = WORKLOADS[name][2]
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"{name:10s} {seconds:7.3f} s CPU (goal <= {goal} s)   load average {load}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
