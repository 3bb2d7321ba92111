"""The one object slime's patched tree reaches megatron_dynbatch through: a micro-batch planner.

The patches give slime a generic hook in its own style (its ``--custom-*-path`` options, loaded
with ``slime.utils.misc.load_function``): ``--micro-batch-planner-path`` names an object that plans
slime's micro-batches, and each pass has one call site that runs ``load_function(path).<method>``
when the option is set. The patched parser's default names :class:`MicroBatchPlanner`; slime's
argument validation calls :meth:`MicroBatchPlanner.validate_args` once, which checks our options
where slime checks its own and keeps the path only when ``--use-dynamic-batch-size`` is on and
``--use-slime-dynamic-batch-size`` is off. That is the one place the condition lives: every call
site reads ``args.micro_batch_planner_path``, ``None`` when slime batches as unpatched.

Nothing heavy is imported here: each method imports what it calls, so slime's argument parser and
rollout manager load this module without torch work.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.hosts import SLIME, check_host_planner

__all__ = ["HOOK_PATH", "OWN_OPTIONS", "MicroBatchPlanner"]

#: What ``--micro-batch-planner-path`` defaults to in the patched parser (patch 0005).
HOOK_PATH = "megatron_dynbatch.integrations.slime.hook.MicroBatchPlanner"
#: Options the patches register for megatron_dynbatch: (flag, attribute, default when not given).
#: They mean something only while our planner runs; given otherwise, they are refused.
OWN_OPTIONS = (
    (SLIME.key("oversize_samples"), "oversize_samples", "allow"),
    (SLIME.key("max_memory_gib"), "max_memory_gib", None),
    (SLIME.key("planner"), "dynamic_batch_planner", None),
    (SLIME.key("cost_microbatch_overhead"), "dynamic_batch_cost_microbatch_overhead", None),
)
_WAY_BACK = "--use-slime-dynamic-batch-size"


def _ours(args: Any) -> bool:
    return bool(getattr(args, "use_dynamic_batch_size", False)) and not getattr(
        args, "use_slime_dynamic_batch_size", False
    )


class MicroBatchPlanner:
    """slime's micro-batch planner hook: one static method per call site of the patches."""

    @staticmethod
    def validate_args(args: Any) -> Optional[str]:
        """slime's ``slime_validate_args`` hands us its namespace: check our options in slime's
        flag names, before any Ray actor or rollout; return the path to keep (``None``: slime's own
        batching runs, every call site of the patches stays off).

        Raises:
            DynBatchValueError: a bad budget, ``--max-memory-gib`` that is not a number of GiB > 0,
                an unknown ``--dynamic-batch-planner``, a negative or non-finite
                ``--dynamic-batch-cost-microbatch-overhead``, or one of our options given while
                slime's own batching runs (it would be silently ignored).
        """
        path = getattr(args, "micro_batch_planner_path", None) or HOOK_PATH
        if not _ours(args):
            given = [
                (flag, getattr(args, name))
                for flag, name, default in OWN_OPTIONS
                if getattr(args, name, default) != default
            ]
            if getattr(args, "use_slime_dynamic_batch_size", False) and not getattr(
                args, "use_dynamic_batch_size", False
            ):
                given.append((_WAY_BACK, True))
            if given:
                flag, value = given[0]
                where = (
                    f"with {_WAY_BACK} (slime's own dynamic batching)"
                    if getattr(args, "use_dynamic_batch_size", False)
                    else "without --use-dynamic-batch-size"
                )
                shown = flag if value is True else f"{flag} {value}"
                raise DynBatchValueError(
                    f"{shown} is read only by megatron_dynbatch's dynamic batching, which is off "
                    f"{where}: it would be ignored. Add --use-dynamic-batch-size"
                    + (
                        f" and drop {_WAY_BACK}"
                        if flag != _WAY_BACK
                        and getattr(args, "use_slime_dynamic_batch_size", False)
                        else ""
                    )
                    + f", or drop {flag}."
                )
            return None
        from megatron_dynbatch.integrations.slime.config import dynbatch_config_from_slime_args
        from megatron_dynbatch.integrations.slime.memory import slime_max_memory_gib

        slime_max_memory_gib(args)  # a number of GiB > 0: not -1, 0, nan or inf
        name = getattr(args, "dynamic_batch_planner", None)
        if name is not None:
            check_host_planner(SLIME, name, SLIME.fixed["layout"])
        # Budgets, --oversize-samples, the planner's name, the micro-batch overhead; then what
        # the first schedule would refuse of the layout and budgets alone.
        dynbatch_config_from_slime_args(args)
        from megatron_dynbatch.integrations.slime.schedule import check_validated_layout

        check_validated_layout(args)
        # MoE settings our padding mask and placeholders cannot run, before any actor.
        from megatron_dynbatch.integrations.moe_args import check_moe_args

        check_moe_args(args, dynamic=True)
        return path

    @staticmethod
    def build_dp_schedule(args, train_parallel_config, total_lengths, **kwargs) -> Any:
        """The rollout side's schedule (slime's ``build_dp_schedule`` signature); its
        ``rank_fields(r)`` are what the rollout ships DP rank ``r``."""
        from megatron_dynbatch.integrations.slime.schedule import build_dp_schedule

        return build_dp_schedule(args, train_parallel_config, total_lengths, **kwargs)

    @staticmethod
    def forward_only_iterators(args: Any, data_iterator: Any) -> Any:
        from megatron_dynbatch.integrations.slime.backend import forward_only_iterators

        return forward_only_iterators(args, data_iterator)

    @staticmethod
    def restore_rollout_order(values_per_microbatch: Any, iterator: Any) -> List[Any]:
        from megatron_dynbatch.integrations.slime.backend import restore_rollout_order

        return restore_rollout_order(values_per_microbatch, iterator)

    @staticmethod
    def agree_on_step(args: Any, data_iterator: Any, num_microbatches: Any, step_id: int) -> None:
        from megatron_dynbatch.integrations.slime.backend import agree_on_step

        agree_on_step(args, data_iterator, num_microbatches, step_id)

    @staticmethod
    def contained_schedule(forward_backward_func: Callable[..., Any], what: str) -> Any:
        from megatron_dynbatch.integrations.slime.backend import contained_schedule

        return contained_schedule(forward_backward_func, what)

    @staticmethod
    def wrap_loss_function(loss_function: Callable[..., Any]) -> Callable[..., Any]:
        from megatron_dynbatch.integrations.slime.backend import wrap_loss_function

        return wrap_loss_function(loss_function)

    @staticmethod
    def model_forward(model: Any, forward_kwargs: Any, data_iterator: Any, batch: Any, args: Any):
        from megatron_dynbatch.integrations.slime.moe import model_forward

        return model_forward(model, forward_kwargs, data_iterator, batch, args)

    @staticmethod
    def mute_phantom_metrics(rollout_data: Any) -> None:
        from megatron_dynbatch.integrations.slime.empty_rank import mute_phantom_metrics

        mute_phantom_metrics(rollout_data)

    @staticmethod
    def reinforce_plus_plus_returns(**kwargs: Any) -> List[Any]:
        """slime's ``get_reinforce_plus_plus_returns``, called as it is on every sample that has a
        loss token; a fully masked sample (a DP rank's phantom, or a real one) gets zero returns
        instead of stopping on slime's assert (it trains nothing either way)."""
        from megatron_dynbatch.integrations.slime.empty_rank import reinforce_plus_plus_returns

        return reinforce_plus_plus_returns(**kwargs)
