"""A validated verify request and the deterministic data every rank derives from it."""

from __future__ import annotations

import dataclasses
import json
import math
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
    plan_samples,
)
from megatron_dynbatch.planning.planner import VARIABLE_ROWS_NOTE
from megatron_dynbatch.planning.spec import round_up
from megatron_dynbatch.runtime.aggregation import check_aggregation
from megatron_dynbatch.settings import setting

__all__ = [
    "DEFAULT_MAX_TOKENS_PER_GPU",
    "SEED",
    "MoESettings",
    "VerifySpec",
    "build_spec",
    "check_fits_machine",
    "plan_warnings",
]

#: Token cap of the bundled set when none is given: small enough that it packs into several
#: micro-batches of the tiny model (``verify``'s default in the settings table).
DEFAULT_MAX_TOKENS_PER_GPU = setting("max_tokens_per_gpu").cli.default_for("verify")
#: Seed of the model weights and of every sample's tokens and advantage.
SEED = 1234
#: Transformer layers of the verify model; pp * vpp must divide it.
NUM_LAYERS = 4
#: Rank processes verify starts per CPU core at most (at least :data:`MIN_RANKS_ALLOWED`): each
#: imports torch and megatron.core (about 400 MiB) and runs both the dynamic and the reference
#: pass; far beyond this a run times out and looks hung (issue 44: --dp-size 64 on 2 cores).
RANKS_PER_CORE = 4
#: Ranks allowed on any machine (the largest layouts the suite checks: dp 2 x pp 2 x tp 2).
MIN_RANKS_ALLOWED = 8
#: Resident memory one verify rank needs (bytes), for the up-front check.
RANK_BYTES = 400 * 2**20
#: Tokens one rank may compute over the planned step (rows x length x micro-batches, placeholders
#: included): 5.6x the bundled check's 1,464 at --max-tokens-per-gpu 128; 2 x [1x3480] (6,960)
#: took 56 s on the loaded 2-core machine. Issue 44: one sample of 3,480 tokens under the default
#: cap made 25 micro-batches of [1x3480] (87,000 tokens a rank), 170 s on a quiet machine,
#: reported as hung under load.
MAX_COMPUTED_TOKENS_PER_RANK = 8192
#: Resident bytes per squared token of attention a verify rank holds: Megatron's local attention
#: keeps every layer's scores and probabilities ([heads, L, L] fp32) for the backward, and the
#: reference keeps every sample's graph until its one backward. Measured: one sample of 8,192
#: tokens peaked at 7.9 GB resident (99 s), [4096] x 4 at dp 2 at 5.5 GB (this says 7.9: an upper
#: bound on the model's 4 heads at tp 1).
ATTENTION_BYTES_PER_SQUARED_TOKEN = 112
#: The share of the available memory the up-front check lets verify's ranks plan to use.
MEMORY_SHARE = 0.8
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
            return plan_samples(samples, self.config)

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
            # The least cap at which some sample keeps a target (its prompt and one more token;
            # the first token predicts nothing; verify runs no cp).
            multiple = parallel.sample_multiple
            need = min(
                round_up(max(prompt or 0, 1) + 1, multiple)
                for length, prompt in zip(
                    sample_set.lengths, sample_set.prompt_lengths, strict=True
                )
                if length > max(prompt or 0, 1)
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


def plan_warnings(spec: VerifySpec) -> list:
    """The planner's warnings for this request (oversize samples run over the cap), as text."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        samples = SampleSet.build(spec.lengths, spec.rollouts, spec.prompts)
        plan_samples(samples, spec.config)
    # verify runs uniform rows only (no --variable-seq-lengths): that way out is not one here.
    return [str(w.message).replace(VARIABLE_ROWS_NOTE, "") for w in caught]


def _cores() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _available_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits_machine(
    spec: VerifySpec,
    *,
    cores: Optional[int] = None,
    available_bytes: Optional[int] = None,
    start_ranks: bool = True,
) -> None:
    """Refuse, before any rank starts, what verify cannot finish on this machine.

    ``start_ranks``: verify starts its own rank processes here (not under torchrun, whose
    processes already exist): their count is checked against the cores and memory. The planned
    work per rank is checked in either case.

    Raises:
        DynBatchValueError: Naming the flags, the limit and settings that fit.
    """
    parallel = spec.config.parallel
    if start_ranks:
        cores = _cores() if cores is None else cores
        allowed = max(MIN_RANKS_ALLOWED, RANKS_PER_CORE * cores)
        available = _available_bytes() if available_bytes is None else available_bytes
        if available is not None:
            allowed = min(allowed, max(1, available // RANK_BYTES))
        if spec.world_size > allowed:
            others = spec.world_size // parallel.dp_size
            flags = (
                f"--dp-size {parallel.dp_size} x --pp-size {parallel.pp_size} x --tp-size "
                f"{parallel.tp_size} = {spec.world_size} rank processes, more than this machine "
                f"runs in reasonable time ({cores} cores, "
                + ("" if available is None else f"{available / 2**30:.1f} GiB available, ")
                + f"at most {allowed} ranks)"
            )
            if others > allowed:
                # No --dp-size helps: one model copy alone is more ranks than allowed.
                raise DynBatchValueError(
                    f"{flags}; --pp-size {parallel.pp_size} x --tp-size {parallel.tp_size} alone "
                    f"is {others}: lower them so that their product is at most {allowed}, see "
                    "the planned schedule of the full size with `megatron-dynbatch plan`, or run "
                    "verify under torchrun on machines that hold the ranks."
                )
            fits = max(1, allowed // others)
            raise DynBatchValueError(
                f"{flags}; verify the same --pp-size and --tp-size at --dp-size {fits}, see the "
                "planned schedule of the full size with `megatron-dynbatch plan --dp-size ...`, "
                "or run verify under torchrun on machines that hold the ranks."
            )
    budget = _memory_budget(start_ranks, available_bytes)
    per_rank = _computed_per_rank(spec.config, spec)
    if per_rank > MAX_COMPUTED_TOKENS_PER_RANK:
        plan = spec.plan()
        worst = max(plan.steps, key=lambda step: step.seq_length)
        longest = max(spec.lengths)
        ran = (
            f"the plan runs {per_rank} tokens a rank ({worst.num_microbatches} micro-batches of "
            f"[{worst.micro_batch_size}x{worst.seq_length}] in its longest step), over the "
            f"{MAX_COMPUTED_TOKENS_PER_RANK} verify runs in minutes on CPU"
        )
        if longest > MAX_COMPUTED_TOKENS_PER_RANK:
            # No cap, dp or policy but cutting it makes one sample fit what a rank runs.
            raise DynBatchValueError(
                f"{ran}; a sample of {longest} tokens alone is more than that: leave it out of "
                "SAMPLES.json or shorten it, or pass --oversize-samples truncate with "
                f"--max-tokens-per-gpu {MAX_COMPUTED_TOKENS_PER_RANK // 4} or less (verify "
                "checks the batching, which samples of a few thousand tokens show as well)."
            )
        # Each fix offered is planned first: only those under the limit are named.
        config, dp = spec.config, parallel.dp_size
        fixes = []
        if parallel.vpp_size > 1 and parallel.group_size > parallel.pp_size:
            smaller = dataclasses.replace(
                parallel, microbatch_group_size_per_vp_stage=parallel.pp_size
            )
            if _fits(dataclasses.replace(config, parallel=smaller), spec, budget):
                fixes.append(
                    f"lower --microbatch-group-size-per-vp-stage to {parallel.pp_size} (a group "
                    f"of {parallel.group_size} runs at least that many micro-batches a rank)"
                )
        if config.layout == "padded" and _fits(
            dataclasses.replace(config, layout="packed"), spec, budget
        ):
            fixes.append(
                "pass --dynamic-batch-layout packed (padded [B, S] rows all take the longest "
                "sample's length)"
            )
        if longest > config.token_cap and _fits(
            dataclasses.replace(config, max_tokens_per_gpu=longest), spec, budget
        ):
            fixes.append(
                f"raise --max-tokens-per-gpu to {longest} (a sample over the cap makes the "
                "micro-batches of its step that long)"
            )
        if longest > config.token_cap and _fits(
            dataclasses.replace(config, oversize_samples="truncate"), spec, budget
        ):
            fixes.append("pass --oversize-samples truncate")
        wider = math.ceil(per_rank * dp / MAX_COMPUTED_TOKENS_PER_RANK) + 1
        others = spec.world_size // dp
        if (not start_ranks or wider * others <= allowed) and _fits(
            dataclasses.replace(config, parallel=dataclasses.replace(parallel, dp_size=wider)),
            spec,
            budget,
        ):
            fixes.append(f"share the samples over more ranks (--dp-size {wider})")
        total = sum(spec.lengths)
        about = MAX_COMPUTED_TOKENS_PER_RANK * dp // 2
        if total > about:
            fixes.append(f"verify fewer samples (about {about} tokens at --dp-size {dp})")
        elif not fixes:
            fixes.append("leave the longest samples out of SAMPLES.json")
        raise DynBatchValueError(
            f"{ran}: SAMPLES.json holds {len(spec.lengths)} samples of {total} tokens in all; "
            + "; or ".join(fixes)
            + "."
        )
    # Within the work a rank runs, the attention it holds can still be more than the memory.
    _check_attention_memory(spec, budget)


def _computed_per_rank(config: PlannerConfig, spec: VerifySpec) -> int:
    """Tokens one rank computes over the plan of ``spec``'s samples under ``config``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        samples = SampleSet.build(spec.lengths, spec.rollouts, spec.prompts)
        plan = plan_samples(samples, config)
    return sum(
        step.num_microbatches * step.micro_batch_size * step.seq_length for step in plan.steps
    )


def _fits(config: PlannerConfig, spec: VerifySpec, budget: Optional[int]) -> bool:
    """Whether ``config`` (one fix applied) plans ``spec``'s samples within what a rank runs and,
    where ``budget`` (bytes) is given, within the memory (:func:`_attention_bytes`)."""
    try:
        if _computed_per_rank(config, spec) > MAX_COMPUTED_TOKENS_PER_RANK:
            return False
        if budget is None:
            return True
        parallel = config.parallel
        ranks = parallel.dp_size * parallel.pp_size * parallel.tp_size
        return _attention_bytes(dataclasses.replace(spec, config=config), config, ranks) <= budget
    except ValueError:  # the fix is refused itself (e.g. a group the count cannot reach)
        return False


def _memory_budget(start_ranks: bool, available_bytes: Optional[int]) -> Optional[int]:
    """The bytes verify's ranks may plan to hold on this machine (``None``: not checked, under
    torchrun or where the memory is unknown)."""
    if not start_ranks:
        return None  # under torchrun the ranks are spread as the launcher chose
    available = _available_bytes() if available_bytes is None else available_bytes
    return None if available is None else int(available * MEMORY_SHARE)


def _attention_bytes(spec: VerifySpec, config: PlannerConfig, ranks: Optional[int] = None) -> int:
    """Upper bound on the resident bytes of verify's ranks on this machine under ``config``: rank 0
    runs the reference (every sample's attention kept until one backward) besides its share of the
    dynamic step; the other ranks it starts each hold one micro-batch's row."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        plan = plan_samples(SampleSet.build(spec.lengths, spec.rollouts, spec.prompts), config)
    kept = plan.kept_lengths()
    reference = sum(kept.get(i, length) ** 2 for i, length in enumerate(spec.lengths))
    row = max(step.micro_batch_size * step.seq_length**2 for step in plan.steps)
    ranks = spec.world_size if ranks is None else ranks
    per_square = ATTENTION_BYTES_PER_SQUARED_TOKEN
    return ranks * RANK_BYTES + per_square * (max(reference, row) + row * (ranks - 1))


def _check_attention_memory(spec: VerifySpec, budget: Optional[int]) -> None:
    """Refuse samples whose attention verify's ranks cannot hold in this machine's memory (the
    kernel would kill a rank minutes in), naming a cap that fits."""
    if budget is None:
        return
    need = _attention_bytes(spec, spec.config)
    if need <= budget:
        return
    # The largest cap (a multiple of 64) at which truncating fits, if any.
    config, cap = spec.config, None
    # (No cap above what a rank runs passes the work check.)
    highest = min(round_up(max(spec.lengths), 64) - 64, MAX_COMPUTED_TOKENS_PER_RANK)
    for candidate in range(highest, 63, -64):
        try:
            trial = dataclasses.replace(
                config, max_tokens_per_gpu=candidate, oversize_samples="truncate"
            )
            # Named only where the run then passes the work check too.
            if _fits(trial, spec, budget):
                cap = candidate
                break
        except ValueError:
            continue
    fix = (
        f"pass --oversize-samples truncate --max-tokens-per-gpu {cap}, or verify fewer or "
        "shorter samples"
        if cap is not None
        else "verify fewer or shorter samples"
    )
    raise DynBatchValueError(
        f"verify would need about {need / 2**30:.1f} GiB on this machine, more than "
        f"{budget / 2**30:.1f} GiB ({MEMORY_SHARE:.0%} of what is available): its reference keeps "
        "every sample's attention scores (quadratic in its length) until one backward, on rank "
        f"0 (the longest sample has {max(spec.lengths)} tokens); {fix}."
    )
