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
The same runs from an installed wheel, without a checkout:
``torchrun --nproc-per-node 2 -m megatron_dynbatch pretrain <arguments>``
(``megatron_dynbatch/integrations/megatron_lm/launch.py``). See docs/megatron-lm-entry.md.
"""

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_dynbatch.integrations.megatron_lm.launch import (  # noqa: E402
    prepare_megatron,
    run_program,
)

prepare_megatron()  # on import too: tests run this file for its set-up alone

from megatron_dynbatch.integrations.megatron_lm.pretrain_gpt import main  # noqa: E402, F401

if __name__ == "__main__":
    run_program()
