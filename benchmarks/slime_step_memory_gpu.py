"""The CUDA branch of slime's per-step memory line (``StepPeakLog``: the peak reset at every
step's start, ``torch.cuda.max_memory_allocated`` read at its end), on known allocations.

GPU only: ``python -m benchmarks.slime_step_memory_gpu``. Three steps with 64 MiB held throughout:
step 0 allocates 256 MiB (expect 320 measured), step 1 32 MiB (expect 96: the reset forgets step
0), step 2 128 MiB under a budget of 80 MiB (expect 192 and the over-budget report).
"""

import torch

from megatron_dynbatch.integrations.slime.step_memory import StepPeakLog

MIB = 1 << 20


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(0))
    log = StepPeakLog()
    held = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")  # alive across steps
    for step, (size, budget) in enumerate(((256, 1024.0), (32, 100.0), (128, 80.0))):
        log.begin(step, [50.0, 60.0], budget)
        transient = torch.empty(size * MIB, dtype=torch.uint8, device="cuda")
        del transient
    log.close()
    del held


if __name__ == "__main__":
    main()
