"""A DP rank that holds no sample of the rollout, through slime's whole actor path.

When a rollout has fewer samples than DP ranks, :func:`~megatron_dynbatch.adapters.slime.
build_dp_schedule` gives some ranks only placeholder micro-batches. Training and log-prob passes
run on them, but slime's per-sample code does not accept an empty rank: its advantages
(``compute_advantages_and_returns``) iterate ``None``, advantage whitening concatenates nothing,
``log_rollout_data`` reads ``value[0]``, and the other ranks then wait in the collectives these
functions run (the whitening all-reduce, the metric gather).

Such a rank gets one *phantom* sample (:func:`add_phantom_sample`): two tokens of padding, one
response token, loss mask 0, reward 0, the placeholder marker as its rollout position, built key by key by the same
:func:`~megatron_dynbatch.integrations.slime.placeholders.placeholder_sample` that builds
placeholder micro-batches. It runs through slime's code like a real sample, so every collective runs in step with the other ranks, and it contributes nothing:

* the loss and gradients: it trains in a micro-batch that was a placeholder (zero loss mask, zero
  ``rollout_mask_sums``), exactly as a placeholder does;
* advantage whitening: slime's statistics are masked, and its mask is 0;
* metrics: :func:`mute_phantom_metrics` makes slime's ``log_rollout_data`` report ``(0, 0)`` for
  every per-sample metric of the rank.

Torch only (no megatron, no slime at import time; under R3 the phantom's routed experts read
the model's shape from Megatron's global args).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_dynbatch.integrations.slime.placeholders import placeholder_sample, rollout_device
from megatron_dynbatch.runtime.placeholders import PLACEHOLDER_INDEX, is_placeholder, padding_tensor

__all__ = [
    "add_phantom_sample",
    "has_phantom",
    "mute_phantom_metrics",
    "reinforce_plus_plus_returns",
]

#: The phantom's prompt and response lengths (slime needs at least one of each).
_PROMPT, _RESPONSE = 1, 1
#: The phantom's value of a per-sample list this package has no rule for (a new slime key): a
#: scalar 0, which slime's masked statistics never see (the phantom's loss mask is 0).
_UNKNOWN_VALUE = 0.0
#: Keys that are not per sample (left alone).
_SCHEDULE_KEYS = ("num_microbatches", "global_batch_sizes", "micro_batch_indices")


def has_phantom(rollout_data: Dict[str, Any]) -> bool:
    """Whether ``rollout_data`` is a rank's whose only sample is the phantom: its rollout
    positions (``partition``) are the placeholder marker only."""
    positions = list(rollout_data.get("partition") or ())
    return bool(positions) and is_placeholder(positions)


def add_phantom_sample(
    rollout_data: Dict[str, Any],
    forward_only: Optional[Tuple[List[List[int]], List[int]]],
    cp_size: int = 1,
) -> Optional[Tuple[List[List[int]], List[int]]]:
    """Give a rank without samples one phantom sample (local index 0), in ``rollout_data``.

    Every empty per-sample list of ``rollout_data`` gets the phantom's value; the phantom takes the
    place of the first placeholder micro-batch of the training schedule (where it is trained,
    contributing nothing, as the placeholder would) and of the first forward-only placeholder
    (where its log-prob is computed, so slime's per-sample lists stay aligned). Returns the
    forward-only schedule with the phantom in it. Only ``rollout_data``'s entries are replaced:
    the lists it held (the schedule's ``partitions[r]``, ``micro_batch_indices[r]``) are not changed.
    """
    assert not rollout_data.get("partition"), "only a rank without samples gets a phantom"
    # slime moved this rank's tensors to its device already; the phantom's go there too.
    device = rollout_device(rollout_data)
    # The phantom is padded to 2 * cp chunks by slime like any sample; two tokens per CP chunk.
    total = max(_PROMPT + _RESPONSE, 2 * cp_size)
    empty = [
        key
        for key, values in rollout_data.items()
        if key not in _SCHEDULE_KEYS and isinstance(values, list) and not values
    ]
    phantom = placeholder_sample(
        rollout_data, empty, total, cp_size=cp_size, device=device, unknown=_UNKNOWN_VALUE
    )
    sums = rollout_data.get("rollout_mask_sums")
    if isinstance(sums, torch.Tensor):
        rollout_data["rollout_mask_sums"] = padding_tensor((1,), sums.dtype, sums.device)
    for key in empty:
        # A new list: the empty one may be the schedule's own (partitions[r] shipped as is).
        rollout_data[key] = [phantom[key]]
    rollout_data.setdefault("partition", [PLACEHOLDER_INDEX])
    micro_batches = rollout_data["micro_batch_indices"]
    assert micro_batches and all(
        is_placeholder(mb) for mb in micro_batches
    ), "a rank without samples has placeholders only"
    rollout_data["micro_batch_indices"] = [[0], *micro_batches[1:]]
    if forward_only is None:
        return None
    forward_micro_batches, rows = forward_only
    forward_micro_batches = [list(mb) for mb in forward_micro_batches]
    forward_micro_batches[0] = [0]
    return forward_micro_batches, rows


#: Attribute of the one-shot wrapper :func:`mute_phantom_metrics` installs: slime's own function.
_ORIGINAL = "_megatron_dynbatch_original"


def _metrics_module() -> Any:
    """The module whose ``gather_log_data`` slime's ``log_rollout_data`` calls (it looks the name
    up in its own module): ``slime.observability.train_metric_utils`` from slime 624b824a on,
    ``slime.backends.megatron_utils.data`` in the commits before it."""
    import importlib

    try:
        return importlib.import_module("slime.observability.train_metric_utils")
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("slime.observability"):
            raise
        return importlib.import_module("slime.backends.megatron_utils.data")


def mute_phantom_metrics(rollout_data: Dict[str, Any]) -> None:
    """Make the ``log_rollout_data`` that slime calls next count nothing for a phantom rank.

    Patch 0006 calls it just before slime's ``log_rollout_data`` (whichever module holds it). slime
    reduces every metric as the sum of the ranks' sums over the sum of their counts. On a phantom
    rank the next ``gather_log_data`` (slime's ``log_rollout_data`` calls it once, on the ranks
    that log) gets a per-sample metric as ``(0, 0)``; a per-rollout mean (log-probs, advantages,
    ...) already has sum 0 on the phantom (its loss mask is 0) and keeps its count of
    ``num_rollouts / dp_size`` (a ``float``) that every rank emits by slime's design, so the
    totals come out right only if it is kept. The wrapper puts slime's function back when it
    runs, and any call of this function first removes a wrapper that never ran (a rank that does
    not log), so a rank with real samples always reports them.
    """
    module = _metrics_module()
    original = getattr(module.gather_log_data, _ORIGINAL, module.gather_log_data)
    module.gather_log_data = original
    if not has_phantom(rollout_data):
        return

    def gather_nothing(metric_name, args, rollout_id, log_dict):
        module.gather_log_data = original  # once: the gather of the log_rollout_data that follows
        empty = {}
        for key, value in log_dict.items():
            if isinstance(value, tuple) and len(value) == 2:
                share = value[1] if isinstance(value[1], float) else 0
                value = (0.0, share)
            empty[key] = value
        return original(metric_name, args, rollout_id, empty)

    setattr(gather_nothing, _ORIGINAL, original)
    module.gather_log_data = gather_nothing


def reinforce_plus_plus_returns(
    *, rewards: torch.Tensor, kl: List[torch.Tensor], loss_masks: List[torch.Tensor], **kwargs: Any
) -> List[torch.Tensor]:
    """slime's ``get_reinforce_plus_plus_returns`` on the samples with a loss token; a fully masked
    sample (the phantom, or a real sample whose loss mask is all 0) gets zero returns, one per
    token of its local KL chunk (what slime returns for it, context-parallel slicing included).

    slime's function asserts on a fully masked sample; the phantom always is one. The call site
    (patch 0007, in slime's ``compute_advantages_and_returns``) runs this only while our planner
    runs; otherwise slime's own function runs and stops on the assert as unpatched slime does.
    Every sample keeps its own rewards, KL and masks (the others are not shifted).
    """
    from slime.utils.ppo_utils import get_reinforce_plus_plus_returns

    keep = [i for i, mask in enumerate(loss_masks) if bool(mask.any())]
    if len(keep) == len(loss_masks):
        return get_reinforce_plus_plus_returns(
            rewards=rewards, kl=kl, loss_masks=loss_masks, **kwargs
        )
    picked = {
        key: [value[i] for i in keep]
        for key, value in kwargs.items()
        if key in ("response_lengths", "total_lengths")
    }
    rest = {k: v for k, v in kwargs.items() if k not in picked}
    kept = get_reinforce_plus_plus_returns(
        rewards=rewards[keep],
        kl=[kl[i] for i in keep],
        loss_masks=[loss_masks[i] for i in keep],
        **picked,
        **rest,
    )
    returns = [padding_tensor(chunk.shape, chunk.dtype, chunk.device) for chunk in kl]
    for i, value in zip(keep, kept, strict=True):
        returns[i] = value
    return returns
