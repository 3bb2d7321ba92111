"""SkyRL's ``validate_cfg`` for ``trainer.use_dynamic_batch_size`` (patch 0001 calls it).

The flag changes only the Megatron worker's micro-batches, so a config that sets it where it would
do nothing is refused at start-up, one line naming the keys and the fix, instead of training as if
it were off (``strategy=fsdp``), failing at the first step (no ``max_tokens_per_microbatch``) or
reading a typo as on (``use_dynamic_batch_size=yes_please`` is a non-empty string).

Standard library only: SkyRL's config validation runs on the driver, before any worker.
"""

from __future__ import annotations

from typing import Any

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.hosts import SKYRL, check_host_budget

__all__ = ["validate_trainer_config"]


def validate_trainer_config(trainer: Any) -> None:
    """Refuse a SkyRL ``trainer`` config whose ``use_dynamic_batch_size`` would do nothing.

    Args:
        trainer: SkyRL's ``TrainerConfig`` (``cfg.trainer``). Read: ``use_dynamic_batch_size``,
            ``strategy``, ``max_tokens_per_microbatch``.

    Raises:
        DynBatchValueError: the flag is not a boolean; it is on with a strategy other than
            ``megatron``; it is on without ``max_tokens_per_microbatch > 0``.
    """
    flag = trainer.use_dynamic_batch_size
    if not isinstance(flag, bool):
        raise DynBatchValueError(
            f"trainer.use_dynamic_batch_size={flag!r} is not a boolean; set it to true or false."
        )
    if not flag:
        return
    if trainer.strategy != "megatron":
        raise DynBatchValueError(
            f"trainer.use_dynamic_batch_size=true plans the Megatron worker's micro-batches only; "
            f"trainer.strategy={trainer.strategy!r} would ignore it: set trainer.strategy=megatron "
            "or trainer.use_dynamic_batch_size=false."
        )
    check_host_budget(SKYRL, trainer.max_tokens_per_microbatch)
