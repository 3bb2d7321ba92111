"""Megatron-LM GPT pretraining with ``--use-dynamic-batch-size``: run it like ``pretrain_gpt.py``.

    torchrun --nproc-per-node 2 launch/pretrain_gpt_dynbatch.py <Megatron-LM GPT arguments> \\
        --use-dynamic-batch-size --max-tokens-per-gpu 4096

Accepts every argument of Megatron-LM 0.19's ``pretrain_gpt.py`` plus megatron_dynbatch's flags,
and runs Megatron's own ``pretrain()``. Before importing ``megatron.training`` it makes sure the
imported tree has ``patches/`` applied: a Megatron-LM checkout already patched with
``launch/apply_patches.sh`` is used as is; otherwise a patched copy of the ``megatron/training``
Python would import is kept under ``~/.cache/megatron_dynbatch`` (``$MEGATRON_DYNBATCH_CACHE``)
and put first on ``sys.path``, and nothing installed is modified. On a machine without CUDA the
CPU support (``megatron_dynbatch/cpu/training_shim.py``) is applied; with CUDA it is not.
See README.md, section "Megatron-LM".
"""

import pathlib
import sys
import warnings

import torch

if not torch.cuda.is_available():
    # The CPU path cannot use transformer-engine or apex; megatron.core says so on import, ten
    # warnings per rank, which buried a start-up error's one line (issue 29). With CUDA they stay.
    warnings.filterwarnings(
        "ignore",
        message=r"(Transformer Engine and Apex are|Apex is) not installed"
        r"|Only transformer-engine>=\S+ supports MoE experts",
        category=UserWarning,
    )

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_dynbatch.integrations.megatron_lm.patched_tree import (  # noqa: E402
    use_patched_training,
)

use_patched_training(REPO / "patches", REPO / "launch" / "apply_patches.sh")

from megatron_dynbatch.cpu.training_shim import (  # noqa: E402
    apply_training_cpu_shim,
    skip_helper_compilation_if_prebuilt,
)

apply_training_cpu_shim()  # a no-op where CUDA exists
skip_helper_compilation_if_prebuilt()  # the megatron-core wheel ships the helpers, not a Makefile

from megatron_dynbatch.integrations.megatron_lm.pretrain_gpt import main  # noqa: E402

if __name__ == "__main__":
    main()
