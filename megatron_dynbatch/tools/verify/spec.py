"""A validated verify request and the deterministic data every rank derives from it."""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from importlib import resources
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import (
    OversizeSampleWarning,
    Plan,
    PlannerConfig,
    SampleSet,
    parse_samples_json,
)
from megatron_dynbatch.planning.planner import VARIABLE_ROWS_NOTE
from megatron_dynbatch.planning.registry import run_planner
from megatron_dynbatch.planning.spec import round_up
from megatron_dynbatch.runtime.aggregation import check_aggregation
from megatron_dynbatch.settings import setting

__all__ = [
    "DEFAULT_MAX_TOKENS_PER_GPU",
    "SEED",
    "MoESettings",
    "VerifySpec",
    "build_spec",
    "least_training_cap",
    "plan_warnings",
]

#: Token cap of the bundled set when none is given: small enough that it packs into several
#: micro-batches of the tiny model (``verify``'s default in the settings table).
DEFAULT_MAX_TOKENS_PER_GPU = setting("max_tokens_per_gpu").cli.default_for("verify")
#: Seed of the model weights and of every sample's tokens and advantage.
SEED = 1234
#: Transformer layers of the verify model; pp * vpp must divide it.
NUM_LAYERS = 4
#: Attention heads of the verify model (the tiny GPT's); tp must divide it (and then also divides
#: its hidden size 32, MLP width 128 and vocabulary 128).
NUM_ATTENTION_HEADS = 4


@dataclass(frozen=True)
class MoESettings:
    """``verify --moe``: every MLP of the verify model is a mixture of experts.

    The router's z-loss is per token, so dynamic batching must reproduce the per-sample reference
    exactly; the load-balancing losses (``aux_loss``, ``seq_aux_loss``, ``global_aux_loss``) are
    defined over a micro-batch (or a row, or the step's micro-batches), which a reference of one
    sample at a time does not have, so verify leaves them off (their rules and measured deviations
    from fixed micro-batches: ``docs/moe.md``).
    """

    num_experts: int = 4
    """Experts per MoE layer."""
    topk: int = 2
    """Experts each token is routed to."""
    ep_size: int = 1
    """Expert-parallel size; it spans data-parallel ranks (it must divide ``dp_size``)."""
    z_loss_coeff: float = 1e-2
    """Coefficient of the router z-loss (0 turns it off)."""

    def __post_init__(self) -> None:
        if not 1 <= self.topk <= self.num_experts:
            raise DynBatchValueError(
                f"--moe top-k {self.topk} must be in [1, num_experts={self.num_experts}]."
            )
        if self.ep_size < 1 or self.num_experts % self.ep_size:
            raise DynBatchValueError(
                f"--moe-ep-size {self.ep_size} must be >= 1 and divide the {self.num_experts} "
                "experts of the verify model; use 1, 2 or 4."
            )
        if not self.z_loss_coeff >= 0:
            raise DynBatchValueError(
                f"--moe-z-loss-coeff {self.z_loss_coeff} must be >= 0 (0 turns the z-loss off)."
            )


@dataclass(frozen=True)
class VerifySpec:
    """Everything a verify run needs; picklable, so it travels to every worker rank."""

    config: PlannerConfig
    """The planner configuration (layout, cap, parallel sizes): built once, never re-derived."""
    lengths: Tuple[int, ...]
    rollouts: Tuple[Any, ...]
    prompts: Tuple[int, ...]
    loss: str
    """One of :data:`megatron_dynbatch.runtime.aggregation.AGGREGATIONS`."""
    seed: int = SEED
    moe: Optional[MoESettings] = None
    """A mixture-of-experts verify model, or None for the dense one."""

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @property
    def world_size(self) -> int:
        parallel = self.config.parallel
        return parallel.dp_size * parallel.pp_size * parallel.tp_size

    @property
    def max_sequence_length(self) -> int:
        """Position-embedding bound of the model: covers the longest sample and every row."""
        return max(256, max(self.lengths), self.config.token_cap)

    def plan(self) -> Plan:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OversizeSampleWarning)  # the CLI reports them
            samples = SampleSet.build(self.lengths, self.rollouts, self.prompts)
            return run_planner(samples, self.config)

    def sample(self, index: int) -> Dict[str, Any]:
        """Deterministic tokens and advantage of one sample (every rank can build any sample)."""
        import torch

        from megatron_dynbatch.tools.testing.tiny_gpt import TINY_VOCAB_SIZE

        generator = torch.Generator().manual_seed(self.seed * 100_003 + index)
        return {
            "tokens": torch.randint(
                0, TINY_VOCAB_SIZE, (self.lengths[index],), generator=generator
            ),
            "prompt_length": self.prompts[index],
            "advantages": torch.randn((), generator=generator),
        }

    def settings(self) -> Dict[str, Any]:
        """Every setting the run used, echoed in the report (each one is also what ran)."""
        parallel = self.config.parallel
        cost = self.config.cost
        return {
            "dp_size": parallel.dp_size,
            "pp_size": parallel.pp_size,
            "vpp_size": parallel.vpp_size,
            # The group exists only when interleaving (vpp > 1); at vpp 1 nothing reads it.
            "microbatch_group_size_per_vp_stage": (
                parallel.group_size if parallel.vpp_size > 1 else None
            ),
            "tp_size": parallel.tp_size,
            "cp_size": parallel.cp_size,
            "sequence_parallel": False,
            "world_size": self.world_size,
            "planner": self.config.planner,
            "layout": self.config.layout,
            "sample_multiple": parallel.sample_multiple,
            "loss_mode": self.loss,
            "max_tokens_per_gpu": self.config.max_tokens_per_gpu,
            "rollouts_per_step": self.config.rollouts_per_step,
            "cost_token_weight": cost.token_weight,
            "cost_attention_weight": cost.attention_weight,
            "cost_response_weight": cost.response_weight,
            "cost_microbatch_overhead": cost.microbatch_overhead,
            "cost_attention": cost.attention_kind(self.config.layout),
            "cost_shape_exchange_overhead": cost.shape_exchange_overhead,
            "min_gain": self.config.min_gain,
            "oversize_samples": self.config.oversize_samples,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "moe": None if self.moe is None else dataclasses.asdict(self.moe),
        }


def bundled_samples() -> list:
    """The bundled long-tailed set (36 samples: 8 GRPO groups and 3 multi-turn rollouts)."""
    text = resources.files("megatron_dynbatch").joinpath("data/verify_samples.json").read_text()
    return json.loads(text)


def check_verify_layout(parallel: Any, moe: Optional[Any] = None) -> None:
    """The layouts the verify model cannot run, refused by their flags (before anything else
    about the budget: a budget named for a layout verify then refused was no fix, a probe).

    Raises:
        DynBatchValueError: layers or heads that do not split, context parallelism, MoE with
            tensor parallelism.
    """
    if NUM_LAYERS % (parallel.pp_size * parallel.vpp_size):
        raise DynBatchValueError(
            f"the verify model has {NUM_LAYERS} layers, which do not split over pp_size="
            f"{parallel.pp_size} x vpp_size={parallel.vpp_size}; use pp*vpp in (1, 2, 4)."
        )
    if NUM_ATTENTION_HEADS % parallel.tp_size:
        raise DynBatchValueError(
            f"the verify model has {NUM_ATTENTION_HEADS} attention heads, which do not split over "
            f"tp_size={parallel.tp_size}; use --tp-size 1, 2 or 4."
        )
    if parallel.cp_size > 1:
        # Megatron's context parallelism lives in transformer-engine's attention; the verify model
        # uses Megatron's local attention (no TE on CPU), which has none.
        raise DynBatchValueError(
            f"verify cannot run cp_size={parallel.cp_size}: its model uses Megatron's local "
            "attention, which has no context parallelism (that needs transformer-engine). Drop "
            "--cp-size (megatron-dynbatch plan --cp-size shows the planned padding)."
        )
    if moe is not None and parallel.tp_size > 1:
        # Megatron refuses MoE with tensor parallelism unless sequence parallelism is on, which
        # the verify model does not run: every rank would fail in Megatron's words.
        raise DynBatchValueError(
            f"verify --moe cannot run --tp-size {parallel.tp_size}: Megatron's MoE layers need "
            "sequence parallelism with tensor parallelism, which the verify model does not run; "
            "drop --tp-size (verify --moe at --tp-size 1), or drop --moe to verify tp "
            f"{parallel.tp_size} on the dense model."
        )


def build_spec(
    config: PlannerConfig,
    *,
    loss: str = "token-mean",
    samples: Optional[Sequence[Any]] = None,
    moe: Optional[MoESettings] = None,
) -> VerifySpec:
    """Validate a verify request (before any process starts) and return its description.

    Args:
        config: The planner configuration to verify (its parallel layout is the one launched).
        loss: The loss aggregation.
        samples: The decoded ``SAMPLES.json`` array; ``None`` uses the bundled set.
        moe: A mixture-of-experts verify model (``verify --moe``), or None for the dense one.

    Raises:
        ValueError: On an unknown loss, bad samples, or a layout verify cannot run as asked
            (never silently another one: a report must state what ran).
    """
    if not isinstance(config, PlannerConfig):
        raise DynBatchValueError(f"config must be a PlannerConfig, got {type(config).__name__}.")
    check_aggregation(loss)
    if samples is not None and not isinstance(samples, (str, bytes, Mapping)):
        samples = list(samples)  # a tuple or another sequence; a JSON object or string is refused
    sample_set = parse_samples_json(bundled_samples() if samples is None else samples)
    parallel = config.parallel
    check_verify_layout(parallel, moe)
    if moe is not None and parallel.dp_size % moe.ep_size:
        raise DynBatchValueError(
            f"--moe-ep-size {moe.ep_size} must divide --dp-size {parallel.dp_size}: Megatron's "
            "expert-parallel groups are made of data-parallel ranks."
        )
    # A sample of L tokens and prompt P has L - max(P, 1) targets (the first token predicts
    # nothing). Where none has any, every loss and gradient is zero on both sides and a pass
    # would compare nothing.
    targets = sum(
        max(0, length - max(prompt or 0, 1))
        for length, prompt in zip(sample_set.lengths, sample_set.prompt_lengths, strict=True)
    )
    if targets == 0:
        raise DynBatchValueError(
            f"SAMPLES.json's {len(sample_set.lengths)} sample(s) have no loss tokens (a sample of "
            "L tokens and prompt_length P trains L - max(P, 1) targets): verify would compare "
            "zero against zero. Give at least one sample more tokens than max(prompt_length, 1) "
            "(e.g. [64, 32])."
        )
    spec = VerifySpec(
        moe=moe,
        config=config,
        lengths=tuple(sample_set.lengths),
        rollouts=tuple(sample_set.rollout_ids),
        prompts=tuple(sample_set.prompt_lengths),
        loss=loss,
    )
    # Plan once here (pure, fast): a plan error (e.g. --oversize-samples error with a sample over
    # the cap) is bad input, reported before any process starts, not a rank failure.
    kept = spec.plan().kept_lengths()
    if kept:
        # Cut to the cap, a sample can keep only prompt tokens: then count what is trained.
        targets = sum(
            max(0, kept.get(i, length) - max(prompt or 0, 1))
            for i, (length, prompt) in enumerate(
                zip(sample_set.lengths, sample_set.prompt_lengths, strict=True)
            )
        )
        if targets == 0:
            keep = max(kept.values())
            need = least_training_cap(
                sample_set.lengths, sample_set.prompt_lengths, parallel.sample_multiple
            )
            raise DynBatchValueError(
                f"--oversize-samples truncate keeps the first {keep} tokens of "
                f"{len(kept)} sample(s), and then no sample has a loss token left (a sample "
                "of L tokens and prompt_length P trains L - max(P, 1) targets): verify would "
                "compare zero against zero. Raise --max-tokens-per-gpu to at least "
                f"{need}, or give samples that train tokens within "
                "the cap."
            )
    return spec


def least_training_cap(
    lengths: Sequence[int], prompts: Sequence[Optional[int]], multiple: int
) -> Optional[int]:
    """The least token cap at which a cut (``--oversize-samples truncate``) leaves some sample a
    loss token: its prompt and one more token (the first token predicts nothing; verify runs no
    cp), padded to ``multiple``; ``None`` where no sample trains a token even whole."""
    needs = [
        round_up(max(prompt or 0, 1) + 1, multiple)
        for length, prompt in zip(lengths, prompts, strict=True)
        if length > max(prompt or 0, 1)
    ]
    return min(needs) if needs else None


def plan_warnings(spec: VerifySpec) -> list:
    """The planner's warnings for this request (oversize samples run over the cap), as text."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        samples = SampleSet.build(spec.lengths, spec.rollouts, spec.prompts)
        run_planner(samples, spec.config)
    # verify runs uniform rows only (no --variable-seq-lengths): that way out is not one here.
    return [str(w.message).replace(VARIABLE_ROWS_NOTE, "") for w in caught]
