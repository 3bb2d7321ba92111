"""``python -m megatron_dynbatch``: the ``megatron-dynbatch`` command (``plan``, ``verify``,
``calibrate``, ``pretrain``); under torchrun, ``torchrun --nproc-per-node N -m megatron_dynbatch
pretrain <Megatron-LM arguments>`` trains from an installed wheel, no checkout needed."""

import sys

from megatron_dynbatch.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
