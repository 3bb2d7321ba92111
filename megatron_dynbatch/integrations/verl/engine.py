"""What verl's patched ``MegatronEngine.forward_backward_batch`` calls with the switch on.

``patches/verl/`` adds ``use_dynamic_batch_size`` to verl's ``McoreEngineConfig``
(``actor_rollout_ref.actor.megatron.use_dynamic_batch_size``, and the critic's) and changes a few
lines of ``verl/workers/engine/megatron/transformer_impl.py``: with it on and verl's own
``use_dynamic_bsz`` on, the engine takes its micro-batches from :func:`prepare_micro_batches`
instead of verl's ``prepare_micro_batches`` -> ``rearrange_micro_batches``, and hands its outputs to
:func:`postprocess` instead of ``postprocess_batch_func``. Training and forward-only passes
(log-probs, values) go through the same two calls. Everything else (verl's forward step, loss
functions, metrics, the schedule call) is verl's own code.

What changes, against verl's ``rearrange_micro_batches``:

* **one plan over every DP rank.** verl dispatches each DP rank its own shard of the batch before
  the engine sees it, so samples stay on their rank: every rank gathers every rank's lengths
  (lengths only, one small all-gather) and derives the same plan with
  :func:`~megatron_dynbatch.planning.sharded.plan_sharded_step`: each rank's own samples packed
  under the budget, the same micro-batch count on every rank by construction (the largest, rounded
  up to ``microbatch_group_size_per_vp_stage`` under virtual pipelining), no MAX all-reduce of
  counts and no "each rank has at least that many samples" assert. A rank with fewer real
  micro-batches runs placeholders after its real ones. The plan's fingerprint is compared on every
  DP rank before the pipeline starts, and an error on one rank is the same error on all.
* **the budget is a hard cap** on the padded footprint of a micro-batch:
  ``max_token_len_per_gpu x context_parallel_size`` tokens, as verl means it
  (``ppo_max_token_len_per_gpu`` for training, ``log_prob_max_token_len_per_gpu`` for forward
  passes; with context parallelism a micro-batch holds ``cp`` times the per-GPU budget, split over
  the CP ranks), where each sample counts its length rounded up to verl's THD alignment
  (``tp x cp x 2`` with CP, else ``tp``). A sample whose real tokens exceed it is refused before
  any model work, naming it (stock verl asserts the same on real tokens); a sample within it whose
  alignment takes it over (a budget that is no multiple of the alignment) runs alone, as stock
  verl accepts it (:data:`~megatron_dynbatch.integrations.hosts.VERL`: the budget counts real
  tokens).
* **placeholders** carry every key of the batch with its dtype and per-sample shape (a copy of the
  rank's shortest sample, so nested keys keep their structure) with every value zeroed except the
  structural ``position_ids``, ``attention_mask`` and ``temperature``: ``loss_mask`` and
  ``response_mask`` 0, so verl's losses (every ``loss_agg_mode``) add exactly 0 for them and its
  sequence counts skip them; their outputs and metrics are dropped in :func:`postprocess` before
  verl's ``postprocess_batch_func`` sees the list.
* **outputs in sample order**: by :func:`~megatron_dynbatch.runtime.restore_order`, as on every
  other path (each local sample exactly once, checked); verl's ``postprocess_batch_func`` then
  concatenates them and gathers losses and metrics.

Refused with the switch on (a ``DynBatchValueError`` naming the setting), at config time by
:mod:`.config` (verl's ``validate_config``, before any worker): a flag that is not a boolean, the
flag without verl's ``use_dynamic_bsz``, dynamic context parallelism (verl's own scheduler), router
replay (its routed-expert tensors are restored by other indices), ``calculate_per_token_loss``
(verl counts a micro-batch's tokens including a placeholder's). Here, at the first batch, as a
backstop and for what only the batch carries: ``force_group_size > 1`` (reward-model pairs; no
config key sets it), a routing-replay request on the batch, ``calculate_per_token_loss`` on the
built model's config.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, List, Optional, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.hosts import (
    VERL,
    Host,
    check_overhead,
    host_config,
    plan_host_step,
)
from megatron_dynbatch.planning import ParallelLayout, PlannerConfig
from megatron_dynbatch.planning.sharded import ShardedPlan
from megatron_dynbatch.planning.spec import setting_flags

__all__ = [
    "PlannedMicroBatches",
    "check_engine",
    "engine_role",
    "placeholder_micro_batch",
    "plan_verl_batch",
    "postprocess",
    "prepare_micro_batches",
    "verl_host",
    "verl_planner_config",
]

#: Keys a placeholder keeps from the sample it copies: they give it a valid structure (positions,
#: the attended tokens, a positive temperature, which verl divides the logits by); every other
#: tensor is zeroed, so it carries no data and no loss weight.
STRUCTURAL_KEYS = ("position_ids", "attention_mask", "temperature")


class PlannedMicroBatches(list):
    """verl's ``indices``: this rank's real micro-batches (local sample indices), with the plan.

    A plain ``list`` of index lists, so verl's ``restore_dynamic_batch(output, indices)`` restores
    the real micro-batches' outputs unchanged; the placeholders, which follow them, are not in it.
    """

    def __init__(self, plan: ShardedPlan, dp_rank: int):
        super().__init__([list(mb) for mb in plan.ranks[dp_rank]])
        self.plan = plan
        self.dp_rank = dp_rank

    @property
    def num_microbatches(self) -> int:
        """Micro-batches the schedule runs on every rank (real + placeholder)."""
        return self.plan.num_microbatches

    def postprocess(
        self, losses_reduced: Sequence[Any], data: Any, postprocess_batch_func: Callable[..., Any]
    ) -> Any:
        """:func:`postprocess` of this plan (what verl's patched engine calls)."""
        return postprocess(losses_reduced, self, data, postprocess_batch_func)

    def real_outputs(self, outputs: Sequence[Any]) -> List[Any]:
        """The real micro-batches' entries of Megatron's ``losses_reduced`` (placeholders dropped).

        Raises:
            DynBatchValueError: when the list does not have one entry per planned micro-batch.
        """
        if len(outputs) != self.num_microbatches:
            raise DynBatchValueError(
                f"{len(outputs)} micro-batch outputs on DP rank {self.dp_rank}; the plan ran "
                f"{self.num_microbatches} ({len(self)} real, then placeholders)."
            )
        return list(outputs[: len(self)])


def check_engine(engine: Any, data: Any, tu: Any) -> None:
    """Refuse settings the planned path does not support, naming the verl key to change."""
    config = engine.engine_config
    role = "critic" if engine_role(engine) == "critic" else "actor_rollout_ref.actor"
    off = f"or set {role}.megatron.use_dynamic_batch_size=false"
    if getattr(config, "dynamic_context_parallel", False):
        raise DynBatchValueError(
            "megatron.dynamic_context_parallel=true has its own micro-batch scheduler; turn it off "
            f"{off}."
        )
    group = tu.get_non_tensor_data(data=data, key="force_group_size", default=1)
    if group != 1:
        raise DynBatchValueError(
            f"force_group_size={group} (reward-model pairs) is not planned by megatron_dynbatch; "
            f"set use_dynamic_batch_size=false for this model {off[2:]}."
        )
    replay = getattr(getattr(config, "router_replay", None), "mode", "disabled")
    routing = tu.get_non_tensor_data(data=data, key="enable_routing_replay", default=False)
    if routing or replay not in (None, "disabled"):
        raise DynBatchValueError(
            f"router replay (router_replay.mode={replay!r}) with use_dynamic_batch_size is not "
            f"supported yet; disable router replay {off}."
        )
    tf_config = getattr(engine, "tf_config", None)
    if tf_config is not None and getattr(tf_config, "calculate_per_token_loss", False):
        raise DynBatchValueError(
            "calculate_per_token_loss=True (Megatron-Bridge turns it on under context "
            "parallelism): verl counts a micro-batch's tokens placeholders included, so the "
            f"gradient normalisation would be off; turn it off {off}."
        )


def _lengths(data: Any) -> List[int]:
    input_ids = data["input_ids"]
    if input_ids.is_nested:
        return [int(n) for n in input_ids.offsets().diff().tolist()]
    return [int(n) for n in data["attention_mask"].sum(dim=1).tolist()]


def verl_planner_config(
    budget: int,
    *,
    pp_size: int,
    vpp_size: int,
    microbatch_group_size_per_vp_stage: Optional[int],
    tp_size: int,
    cp_size: int,
    packed: bool,
    host: Optional[Host] = None,
    planner: Optional[str] = None,
    microbatch_overhead: Optional[float] = None,
    role: str = "actor",
) -> PlannerConfig:
    """The planner config of one rank's samples under verl's budget (``max_token_len_per_gpu``);
    ``planner``: the planner ``megatron.dynbatch.planner`` names (default ours);
    ``microbatch_overhead``: ``megatron.dynbatch.cost_microbatch_overhead``, one micro-batch's
    fixed cost in tokens of linear work (``None``: assumed, 2% of a full micro-batch).

    Raises:
        DynBatchValueError: when the budget is not a positive integer, naming verl's keys.
    """
    # The config check refuses a bad layout at config time; a config built otherwise is refused
    # here, still in the option names of the engine's role (``role``: ``actor``, ``ref``,
    # ``critic``), not in ours.
    from megatron_dynbatch.integrations.verl.config import ACTOR, role_layout_flags

    prefix = {"critic": "critic", "ref": "actor_rollout_ref.ref"}.get(role, ACTOR)
    with setting_flags(role_layout_flags(prefix), tool="verl"):
        parallel = ParallelLayout(
            dp_size=1,
            pp_size=pp_size,
            vpp_size=vpp_size,
            microbatch_group_size_per_vp_stage=(
                microbatch_group_size_per_vp_stage if vpp_size > 1 else None
            ),
            tp_size=tp_size,
            cp_size=cp_size,
        )
    # Checked at config time too (config.dynbatch_settings); here for a config built otherwise.
    key = "megatron.dynbatch.cost_microbatch_overhead"
    overhead = check_overhead(microbatch_overhead, f"{key}={microbatch_overhead!r}", f"{key}=330")
    return host_config(
        host or VERL,
        {"max_token_len_per_gpu": budget},
        parallel,
        fixed={
            "layout": "packed" if packed else "padded",
            **({"planner": planner} if planner else {}),
            **({"cost_microbatch_overhead": overhead} if overhead is not None else {}),
        },
        # verl's THD forward (use_remove_padding, variable_seq_lengths) runs each micro-batch as
        # one row of its own samples at their alignment: costed at the cap, every micro-batch
        # looked alike and the planner split ranks into more, shorter ones than verl's own
        # (up to 27% slower, benchmarks/verl_as_run.py).
        row_multiple=1 if packed else None,
    )


def verl_host(engine: str = "actor", forward_only: bool = False, engine_config: Any = None) -> Host:
    """The :data:`~megatron_dynbatch.integrations.hosts.VERL` record naming the budget key of
    ``engine`` (``actor``, ``ref``, ``critic``) for this pass (:func:`.config.budget_key`; the
    engine's config, where given, tells which trainer set the critic's training budget)."""
    from megatron_dynbatch.integrations.verl.config import budget_key

    key = budget_key(engine, forward_only, engine_config)
    return replace(VERL, keys={**VERL.keys, "max_tokens_per_gpu": key})


def engine_role(engine: Any) -> str:
    """Which of verl's engines this is: ``critic`` (a value head), ``ref`` (a forward-only engine
    config: the reference model) or ``actor``."""
    if "ValueHead" in type(engine).__name__:
        return "critic"
    if getattr(getattr(engine, "engine_config", None), "forward_only", False):
        return "ref"
    return "actor"


def plan_verl_batch(
    lengths_per_rank: Sequence[Sequence[int]],
    config: PlannerConfig,
    *,
    host: Optional[Host] = None,
) -> ShardedPlan:
    """Every DP rank's micro-batches of one verl batch, from every rank's lengths.

    The lengths, the budget and oversize samples are checked by
    :func:`~megatron_dynbatch.integrations.hosts.plan_host_step`, in verl's keys.

    ``host``: :func:`verl_host` of the engine and pass (names their budget key); the actor's
    training pass by default.

    Raises:
        DynBatchValueError: for a rank without samples, a sample without tokens, or a sample whose
            real tokens exceed the cap (naming the rank, the sample and verl's keys).
    """
    host = host or VERL
    for rank, lengths in enumerate(lengths_per_rank):
        if hasattr(lengths, "__len__") and not len(lengths):  # arrays: no plain truth value
            raise DynBatchValueError(
                f"DP rank {rank} holds no sample; verl's dispatch gives every DP rank a shard "
                "(its batch must be divisible by the data-parallel size)."
            )
    # A placeholder is a copy of the rank's shortest sample (placeholder_micro_batch).
    return plan_host_step(host, lengths_per_rank, config, placeholder_copies_shortest=True)


#: verl's per-sample media (``pixel_values``, ``image_grid_thw``, ...), a non-tensor stack of dicts.
MULTI_MODAL_KEY = "multi_modal_inputs"


def placeholder_micro_batch(data: Any, template_index: int, tu: Any) -> Any:
    """A one-sample micro-batch with every key of ``data``, no data and no loss weight.

    A copy of sample ``template_index`` (the rank's shortest: the cheapest valid structure) with
    every tensor zeroed except :data:`STRUCTURAL_KEYS`; non-tensor entries are kept except its
    media (:data:`MULTI_MODAL_KEY`, emptied: a text sample), and the
    non-tensor :data:`~megatron_dynbatch.runtime.placeholders.MARKER_KEY` (the placeholder marker
    as its sample index) marks it for verl's forward step (:func:`.moe.is_placeholder_batch`).
    """
    import torch

    from megatron_dynbatch.runtime.placeholders import (
        MARKER_KEY,
        PLACEHOLDER_INDEX,
        placeholder_tensor,
    )

    placeholder = tu.index_select_tensor_dict(data, [template_index])
    for key in list(placeholder.keys()):
        value = placeholder.get(key)
        if key in STRUCTURAL_KEYS or not isinstance(value, torch.Tensor):
            continue
        placeholder[key] = placeholder_tensor(value)
    if MULTI_MODAL_KEY in placeholder.keys():
        # Its image tokens are zeroed with input_ids, so it carries no media either (a probe:
        # the template's pixel_values with no image token, which VLMs refuse as a mismatch of
        # image features and tokens); verl's extract_multi_modal_inputs reads {} as a text sample.
        tu.assign_non_tensor(placeholder, **{MULTI_MODAL_KEY: [{}]})
    # verl's forward step masks a placeholder from MoE routers (.moe.mask_placeholder_routing).
    tu.assign_non_tensor(placeholder, **{MARKER_KEY: PLACEHOLDER_INDEX})
    return placeholder


def prepare_micro_batches(
    engine: Any, data: Any, vpp_size: Optional[int] = None, forward_only: bool = False
) -> Tuple[List[Any], PlannedMicroBatches]:
    """This DP rank's micro-batches of ``data`` (its shard of the batch) and verl's ``indices``.

    Every DP rank of the engine calls it for the same step (verl's workers run
    ``forward_backward_batch`` together). Reads the budget from ``data["max_token_len_per_gpu"]``
    (set by verl's worker from ``ppo_max_token_len_per_gpu`` / ``log_prob_max_token_len_per_gpu``)
    and the layout from Megatron's ``parallel_state`` and the engine's config. Messages name the
    budget key of this engine and pass (:func:`engine_role`, ``forward_only``).

    Raises:
        StepAgreementError: on every DP rank when any rank failed (naming the rank and why).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from verl.utils import tensordict_utils as tu

    from megatron_dynbatch.mcore.agreement import gather_lengths, step_agreement

    vpp = vpp_size or 1
    role = engine_role(engine)
    host = verl_host(role, forward_only, engine.engine_config)
    group = engine.get_data_parallel_group()
    what = "verl forward_backward_batch"
    with step_agreement(group, what=f"{what}: checking this rank's samples"):
        check_engine(engine, data, tu)
        settings = getattr(engine.engine_config, "dynbatch", None) or {}
        config = verl_planner_config(
            data["max_token_len_per_gpu"],
            pp_size=mpu.get_pipeline_model_parallel_world_size(),
            vpp_size=vpp,
            microbatch_group_size_per_vp_stage=getattr(
                engine.tf_config, "microbatch_group_size_per_vp_stage", None
            ),
            tp_size=mpu.get_tensor_model_parallel_world_size(),
            cp_size=engine.engine_config.context_parallel_size,
            packed=bool(engine.engine_config.use_remove_padding),
            host=host,
            # verl's one dict option (megatron.dynbatch): the planner registered by this name,
            # and the per-micro-batch overhead where the user tells it.
            planner=settings.get("planner"),
            microbatch_overhead=settings.get("cost_microbatch_overhead"),
            role=role,
        )
        real = _lengths(data)
        lengths = real
        if not engine.engine_config.use_remove_padding and getattr(
            engine.engine_config, "pad_bshd_to_minibatch_max", False
        ):
            # verl pads every BSHD micro-batch to this rank's longest sample: that is each
            # sample's footprint.
            lengths = [max(real, default=0)] * len(real)
    gathered = gather_lengths(lengths, group)
    dp_rank = dist.get_rank(group)
    with step_agreement(group, what=f"{what}: planning") as agreement:
        plan = plan_verl_batch(gathered, config, host=host)
        agreement.fingerprint = plan.fingerprint()
        indices = PlannedMicroBatches(plan, dp_rank)
        micro_batches = [tu.index_select_tensor_dict(data, mb) for mb in indices]
        if plan.placeholders(dp_rank):
            shortest = min(range(len(real)), key=lambda i: (real[i], i))
            filler = placeholder_micro_batch(data, shortest, tu)
            micro_batches.extend(filler.clone() for _ in range(plan.placeholders(dp_rank)))
    return micro_batches, indices


def postprocess(
    losses_reduced: Sequence[Any],
    indices: PlannedMicroBatches,
    data: Any,
    postprocess_batch_func: Callable[..., Any],
) -> Any:
    """verl's ``postprocess_batch_func`` on the real micro-batches' outputs, in sample order.

    The order is restored by :func:`megatron_dynbatch.runtime.restore_order`, the one function every
    integration uses (strict: a sample missing, repeated or not this rank's is an error): each
    ``model_output`` key's per-sample rows, cut out of the real micro-batches, come back in the
    batch's order. verl's function then only concatenates them and gathers losses and metrics
    (it is handed the identity order, so its own ``restore_dynamic_batch`` changes nothing).
    """
    import torch

    from megatron_dynbatch.runtime.reorder import restore_order

    real = indices.real_outputs(losses_reduced)
    covered = sorted(i for mb in indices for i in mb)
    if covered != list(range(len(data))):
        raise DynBatchValueError(
            f"the plan of DP rank {indices.dp_rank} covers {len(covered)} samples, the batch has "
            f"{len(data)}; every sample must come back exactly once."
        )
    per_key: dict = {}
    for m, (mb, output) in enumerate(zip(indices, real, strict=True)):
        for key, value in (output.get("model_output") or {}).items():
            rows = value.unbind()
            if len(rows) != len(mb):
                raise DynBatchValueError(
                    f"model_output[{key!r}] of micro-batch {m} on DP rank {indices.dp_rank} has "
                    f"{len(rows)} rows for the micro-batch's {len(mb)} samples {list(mb)}."
                )
            per_key.setdefault(key, []).append(dict(zip(mb, rows, strict=True)))
    outputs = [{k: v for k, v in output.items() if k != "model_output"} for output in real]
    if per_key:
        outputs[0]["model_output"] = {
            key: torch.nested.as_nested_tensor(restore_order(parts, len(data)), layout=torch.jagged)
            for key, parts in per_key.items()
        }
    return postprocess_batch_func(output_lst=outputs, indices=[covered], data=data)
