"""SkyRL's micro-batch counts and KL row fill on issue 34's case, ours against SkyRL's own packer.

64 samples a DP rank of 200-1500 tokens (seeded), dp 2, pp 2, ``max_tokens_per_microbatch=8192``;
rank 0's first sample is set to 7192 / 8191 / 8192 / 8292 tokens. Printed per case: the
micro-batches a rank and the rows ``B`` of :func:`plan_skyrl_minibatch` and of SkyRL's own
``TokenBasedBatchIterator`` packer (``make_seq_packer("balanced")``, loaded from ``SKYRL_DIR``),
and each one's row fill (real rows / all rows of the real micro-batches). SkyRL's KL term is a
per-micro-batch mean over rows, placeholder rows included, so a KL value the same on every sample
comes out multiplied by the row fill.

    SKYRL_DIR=/path/to/SkyRL .venv/bin/python -m benchmarks.skyrl_counts
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import random
import warnings

from megatron_dynbatch.integrations.skyrl.plan import plan_skyrl_minibatch

BUDGET = 8192


def _skyrl_packer():
    root = os.environ.get("SKYRL_DIR")
    if not root:
        return None
    path = pathlib.Path(root) / "skyrl" / "train" / "dataset" / "bin_packing.py"
    spec = importlib.util.spec_from_file_location("skyrl_bin_packing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_seq_packer


def main() -> None:
    rng = random.Random(0)
    base = [[rng.randint(200, 1500) for _ in range(64)] for _ in range(2)]
    make_seq_packer = _skyrl_packer()
    for longest in (7192, 8191, 8192, 8292):
        lengths = [list(rank) for rank in base]
        lengths[0][0] = longest
        samples = sum(len(rank) for rank in lengths)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_skyrl_minibatch(lengths, BUDGET, pp_size=2)
        real = sum(len(rank) for rank in plan.ranks)
        line = (
            f"longest {longest}: ours {plan.num_microbatches} a rank, B={plan.rows}, "
            f"row fill {samples / (real * plan.rows):.3f}"
        )
        if make_seq_packer is not None:
            packed = [make_seq_packer("balanced", bin_capacity=BUDGET).pack(r) for r in lengths]
            rows = max(len(mb) for rank in packed for mb in rank)
            count = max(len(rank) for rank in packed)
            fill = samples / (sum(len(rank) for rank in packed) * rows)
            line += f"; SkyRL's packer {count} a rank, B={rows}, row fill {fill:.3f}"
        print(line)


if __name__ == "__main__":
    main()
