"""What a slime-style RL trainer calls to replace its own dynamic batching.

slime keeps a rollout batch as ``rollout_data``: a dict of per-sample lists. Token-level keys cover
the whole sample (``tokens``) or only its response (``loss_masks``, ``advantages``, ``log_probs``,
...: ``response_lengths[i]`` values each); ``total_lengths`` and ``response_lengths`` give the
sizes. A trainer today builds data iterators and a per-step micro-batch count from it, runs
Megatron's ``forward_backward_func`` per step, and scatters forward-only outputs back to rollout
order. :class:`DynamicBatching` does those three things with the global planner:

    batching = DynamicBatching(config, parallel, aggregation="token-mean",
                               response_keys=("advantages", "old_log_probs"))
    plan = batching.plan(rollout_data)                           # every rank, same plan
    for step in range(len(plan.steps)):
        iterators, num_microbatches = batching.data_iterators(rollout_data, plan, step, dp_rank,
                                                              num_model_chunks=len(model))
        shape = batching.schedule_shape(plan, step)              # seq_length, micro_batch_size
        forward_backward_func(..., data_iterator=iterators, num_microbatches=num_microbatches,
                              **shape)
    # log-probs: batching.plan(rollout_data, forward_only=True), run forward-only, then
    log_probs = batching.response_outputs(rollout_data, per_sample_outputs)

The loss is exact for every aggregation through Megatron's own mechanism: call
:func:`megatron_dynbatch.mcore.step.configure_loss` once on the model chunks, and return
:func:`megatron_dynbatch.runtime.microbatch_loss` from the loss function.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from megatron_dynbatch.config import DynBatchConfig
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import ParallelLayout, Plan, SampleSet
from megatron_dynbatch.planning.registry import run_planner
from megatron_dynbatch.planning.spec import check_int
from megatron_dynbatch.runtime import (
    AGGREGATIONS,
    BatchSchema,
    FieldSpec,
    materialize_microbatches,
    restore_order,
)
from megatron_dynbatch.runtime.iterators import chunk_data_iterators

__all__ = ["DynamicBatching"]

RolloutData = Mapping[str, Sequence[Any]]


def _as_tensor(value: Any, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    return tensor.to(dtype) if dtype is not None else tensor


class DynamicBatching:
    """Planner + materializer + reorder for one trainer, configured once.

    Args:
        config: The plugin settings (budgets, layout, cost model).
        parallel: The Megatron layout (dp, pp, vpp, group, tp, cp).
        aggregation: The loss aggregation the trainer uses (one of ``AGGREGATIONS``).
        response_keys: Per-token keys holding one value per *response* token (slime convention),
            carried into micro-batches aligned with the labels they score.
        sample_keys: Per-sample scalar keys (rewards, ...), broadcast over the sample's tokens.
        rollout_id_key: The key of per-sample rollout ids (samples of one prompt group share one);
            absent, every sample is its own rollout unless ``samples_per_rollout`` groups them.
        samples_per_rollout: GRPO's ``n_samples_per_prompt`` when ids are not stored.
    """

    def __init__(
        self,
        config: DynBatchConfig,
        parallel: ParallelLayout,
        *,
        aggregation: str = "token-mean",
        response_keys: Sequence[str] = ("advantages",),
        sample_keys: Sequence[str] = (),
        rollout_id_key: str = "rollout_ids",
        samples_per_rollout: Optional[int] = None,
    ) -> None:
        if aggregation not in AGGREGATIONS:
            raise DynBatchValueError(f"aggregation={aggregation!r} is not one of {AGGREGATIONS}.")
        if samples_per_rollout is not None:
            samples_per_rollout = check_int(
                "samples_per_rollout",
                samples_per_rollout,
                1,
                "pass GRPO's n_samples_per_prompt as an integer >= 1, or None.",
            )
        for name, keys in (("response_keys", response_keys), ("sample_keys", sample_keys)):
            if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
                raise DynBatchValueError(
                    f"{name}={keys!r} must be a sequence of key names, e.g. ('advantages',)."
                )
        self.config = config
        self.parallel = parallel
        self.aggregation = aggregation
        self.response_keys = tuple(response_keys)
        self.sample_keys = tuple(sample_keys)
        self.rollout_id_key = rollout_id_key
        self.samples_per_rollout = samples_per_rollout
        fields = [
            FieldSpec(name=key, kind="token", dtype=torch.float32, shift_to_labels=True)
            for key in self.response_keys
        ] + [FieldSpec(name=key, kind="sample", dtype=torch.float32) for key in self.sample_keys]
        self.schema = BatchSchema(fields=tuple(fields))

    # -- planning ------------------------------------------------------------------------------

    def _lengths(self, rollout_data: RolloutData) -> Tuple[List[int], List[int]]:
        if not isinstance(rollout_data, Mapping):
            raise DynBatchValueError(
                f"rollout_data must be a dict of per-sample lists, got {type(rollout_data).__name__}."
            )
        for key in ("tokens", "total_lengths", "response_lengths"):
            if key not in rollout_data:
                raise DynBatchValueError(
                    f"rollout_data has no {key!r} (keys: {sorted(rollout_data)})."
                )
        fix = "store every sample's token count as an integer."
        totals = [
            check_int(f"total_lengths[{i}]", x, 1, fix)
            for i, x in enumerate(rollout_data["total_lengths"])
        ]
        responses = [
            check_int(f"response_lengths[{i}]", x, 0, fix)
            for i, x in enumerate(rollout_data["response_lengths"])
        ]
        n = len(rollout_data["tokens"])
        if len(totals) != n or len(responses) != n:
            raise DynBatchValueError(
                f"rollout_data has {n} token lists, {len(totals)} total_lengths and "
                f"{len(responses)} response_lengths; they must be one per sample."
            )
        for i, (tokens, total, response) in enumerate(
            zip(rollout_data["tokens"], totals, responses, strict=True)
        ):
            if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
                raise DynBatchValueError(
                    f"sample {i}: tokens={tokens!r} must be a list or 1-d tensor of token ids."
                )
            if len(tokens) != total:
                raise DynBatchValueError(
                    f"sample {i}: {len(tokens)} tokens but total_lengths[{i}]={total}."
                )
            if response > total:
                raise DynBatchValueError(
                    f"sample {i}: response_lengths[{i}]={response} outside [0, total={total}]."
                )
        return totals, responses

    def _rollout_ids(self, rollout_data: RolloutData, n: int):
        if self.rollout_id_key in rollout_data:
            ids = rollout_data[self.rollout_id_key]
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
                raise DynBatchValueError(
                    f"rollout_data[{self.rollout_id_key!r}] must be a list of one id per sample, "
                    f"got {type(ids).__name__}."
                )
            # numpy / torch integer ids become ints; strings stay strings (the planner checks).
            return [
                (
                    i
                    if isinstance(i, str) or i is None
                    else check_int(
                        f"{self.rollout_id_key}[{n_}]", i, -(2**63), "store int or str rollout ids."
                    )
                )
                for n_, i in enumerate(ids)
            ]
        if self.samples_per_rollout is not None:
            if n % self.samples_per_rollout:
                raise DynBatchValueError(
                    f"{n} samples do not split into groups of samples_per_rollout="
                    f"{self.samples_per_rollout}; store {self.rollout_id_key!r} per sample instead."
                )
            return [i // self.samples_per_rollout for i in range(n)]
        return None

    def plan(self, rollout_data: RolloutData, *, forward_only: bool = False) -> Plan:
        """The global schedule of a rollout batch (training steps, or one forward-only pass)."""
        totals, responses = self._lengths(rollout_data)
        config = self.config.planner_config(self.parallel, forward_only=forward_only)
        if forward_only and config.oversize_samples == "truncate":
            # Outputs are per token (log-probs of every response token): a forward-only pass
            # keeps whole samples; only training cuts them.
            config = dataclasses.replace(config, oversize_samples="allow")
        prompts = [t - r for t, r in zip(totals, responses, strict=True)]
        ids = self._rollout_ids(rollout_data, len(totals))
        return run_planner(SampleSet.build(totals, ids, prompts), config)

    # -- materialising -------------------------------------------------------------------------

    def _values(self, rollout_data: RolloutData, key: str, index: int) -> Any:
        if key not in rollout_data:
            raise DynBatchValueError(
                f"rollout_data has no {key!r}, which this DynamicBatching declares (keys: "
                f"{sorted(rollout_data)}); store it per sample or drop it from response_keys / "
                "sample_keys."
            )
        values = rollout_data[key]
        if len(values) <= index:
            raise DynBatchValueError(
                f"rollout_data[{key!r}] has {len(values)} entries, no entry for sample {index}; "
                "store one per sample."
            )
        return values[index]

    def sample(self, rollout_data: RolloutData, index: int) -> Dict[str, Any]:
        """One sample in the runtime's form: response-only keys spread over the full length."""
        totals, responses = self._lengths(rollout_data)
        index = check_int("index", index, 0, "pass a sample index of rollout_data.")
        if index >= len(totals):
            raise DynBatchValueError(
                f"sample index {index} is out of range: rollout_data has {len(totals)} samples."
            )
        total, response = totals[index], responses[index]
        return self._sample(rollout_data, index, total, response)

    def _sample(
        self, rollout_data: RolloutData, index: int, total: int, response: int
    ) -> Dict[str, Any]:
        prompt = total - response
        tokens = _as_tensor(rollout_data["tokens"][index])
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise DynBatchValueError(
                f"sample {index}: tokens have dtype {tokens.dtype}; token ids must be integers "
                "(a float id would be truncated silently)."
            )
        if tokens.numel() and int(tokens.min()) < 0:
            raise DynBatchValueError(
                f"sample {index}: token id {int(tokens.min())} is negative; token ids must be >= 0."
            )
        sample: Dict[str, Any] = {"tokens": tokens.to(torch.int64).reshape(-1)}
        full_mask = torch.zeros(total)
        if "loss_masks" in rollout_data:
            mask = _as_tensor(self._values(rollout_data, "loss_masks", index), torch.float32)
            if mask.numel() != response:
                raise DynBatchValueError(
                    f"sample {index}: loss_masks has {mask.numel()} values for response_length="
                    f"{response}."
                )
            full_mask[prompt:] = mask.reshape(-1)
        else:
            full_mask[prompt:] = 1.0
        sample["loss_mask"] = full_mask
        for key in self.response_keys:
            values = _as_tensor(self._values(rollout_data, key, index), torch.float32)
            if values.numel() != response:
                raise DynBatchValueError(
                    f"sample {index}: {key} has {values.numel()} values for response_length="
                    f"{response}; response keys hold one value per response token."
                )
            full = torch.zeros(total)
            full[prompt:] = values.reshape(-1)
            sample[key] = full
        for key in self.sample_keys:
            value = _as_tensor(self._values(rollout_data, key, index), torch.float32)
            if value.numel() != 1:
                raise DynBatchValueError(
                    f"sample {index}: {key} has {value.numel()} values; sample keys hold one "
                    "value per sample."
                )
            sample[key] = value.reshape(())
        return sample

    @staticmethod
    def _step(plan: Plan, step: int):
        step = check_int("step", step, 0, "pass a step index of the plan.")
        if step >= len(plan.steps):
            raise DynBatchValueError(
                f"step={step} is out of range: the plan has {len(plan.steps)} step(s), "
                f"0 .. {len(plan.steps) - 1}."
            )
        return plan.steps[step]

    def data_iterators(
        self,
        rollout_data: RolloutData,
        plan: Plan,
        step: int,
        dp_rank: int,
        *,
        num_model_chunks: int = 1,
        device: Optional[Union[str, torch.device]] = None,
    ) -> Tuple[Union[Iterator[dict], List[Iterator[dict]]], int]:
        """This rank's data iterator(s) and micro-batch count for one step, Megatron's form.

        With interleaving (``num_model_chunks > 1``) one iterator per model chunk walks the same
        micro-batches, as Megatron's interleaved schedule expects.
        """
        step_plan = self._step(plan, step)
        dp_rank = check_int("dp_rank", dp_rank, 0, "pass this rank's data-parallel index.")
        totals, responses = self._lengths(rollout_data)
        mine = {
            i: self._sample(rollout_data, i, totals[i], responses[i])
            for mb in step_plan.rank_microbatches(dp_rank)
            for i in mb
        }
        microbatches = materialize_microbatches(
            step_plan,
            dp_rank,
            mine,
            self.schema,
            layout=plan.layout,
            sample_multiple=plan.sample_multiple,
            device=device,
        )
        return chunk_data_iterators(microbatches, num_model_chunks), step_plan.num_microbatches

    @staticmethod
    def schedule_shape(plan: Plan, step: int) -> Dict[str, int]:
        """``seq_length`` and ``micro_batch_size`` for ``forward_backward_func`` of a step."""
        step_plan = DynamicBatching._step(plan, step)
        return {"seq_length": step_plan.seq_length, "micro_batch_size": step_plan.micro_batch_size}

    # -- outputs -------------------------------------------------------------------------------

    def response_outputs(
        self,
        rollout_data: RolloutData,
        per_sample: Union[Mapping[int, torch.Tensor], Sequence[Mapping[int, torch.Tensor]]],
    ) -> List[torch.Tensor]:
        """Forward-only outputs back in rollout order, cut to each sample's response tokens.

        ``per_sample`` maps global sample index -> ``[L_i]`` per-token output where entry ``j``
        scores token ``j + 1`` (what :func:`megatron_dynbatch.mcore.step.forward_only_outputs`
        returns; pass a list of such dicts gathered from every rank). The response of length R
        is scored at entries ``L - R - 1 .. L - 2``. Raises ValueError on a missing or duplicated
        sample.
        """
        totals, responses = self._lengths(rollout_data)
        ordered = restore_order(per_sample, len(totals))
        out = []
        for i, (values, total, response) in enumerate(zip(ordered, totals, responses, strict=True)):
            if values.shape[0] != total:
                raise DynBatchValueError(
                    f"sample {i}: output has {values.shape[0]} entries for length {total}."
                )
            start = total - response - 1
            if start < 0:  # a sample that is all response: its first token has no score
                out.append(
                    torch.cat([values.new_zeros((1,) + values.shape[1:]), values[: total - 1]])
                )
            else:
                out.append(values[start : total - 1])
        return out
