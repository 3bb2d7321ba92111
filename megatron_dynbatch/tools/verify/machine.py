"""What ``megatron-dynbatch verify`` can finish on this machine, refused before any rank starts.

The rank processes it would start against the cores and memory; the tokens one rank computes over
the planned step against what runs in minutes on CPU; the attention the ranks hold (the reference
keeps every sample's scores until its one backward) against the memory. Every fix a refusal names
is planned first and named only where it passes (issue 44; a probe of ``verify --json``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Optional

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import OversizeSampleWarning, PlannerConfig, SampleSet
from megatron_dynbatch.planning.registry import run_planner
from megatron_dynbatch.planning.spec import round_up
from megatron_dynbatch.tools.verify.spec import VerifySpec, least_training_cap

__all__ = ["check_fits_machine"]

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
        if spec.config.oversize_samples == "truncate":
            # Cut to the cap, the longest sample is no longer than it (a re-probe: a cut sample
            # was still told to be left out, and the fix for the rest was never named).
            longest = min(longest, spec.config.longest_fitting)
        ran = (
            f"the plan runs {per_rank} tokens a rank ({worst.num_microbatches} micro-batches of "
            f"[{worst.micro_batch_size}x{worst.seq_length}] in its longest step), over the "
            f"{MAX_COMPUTED_TOKENS_PER_RANK} verify runs in minutes on CPU"
        )
        # Each fix offered is planned first: only those under the limit are named.
        config, dp = spec.config, parallel.dp_size
        if longest > MAX_COMPUTED_TOKENS_PER_RANK:
            # No cap, dp or policy but cutting it makes one sample fit what a rank runs; cut, the
            # rest may still be more than a rank runs (a probe: the fix named alone was refused
            # again, with the same words), and then more ranks share them.
            cap = min(config.max_tokens_per_gpu, MAX_COMPUTED_TOKENS_PER_RANK // 4)
            # A cut that leaves no sample a loss token is refused next (a probe: "128 or less"
            # for a 500-token prompt): the cap keeps some sample's prompt and a target.
            need = least_training_cap(spec.lengths, spec.prompts, parallel.sample_multiple)
            tries = []
            if need is not None:
                cap = max(cap, need)
                cut = dataclasses.replace(
                    config, oversize_samples="truncate", max_tokens_per_gpu=cap
                )
                span = f"from {need} to {cap}" if need < cap else f"{cap}"
                truncate = f"pass --oversize-samples truncate with --max-tokens-per-gpu {span}"
                tries.append((cut, truncate))
            if tries and config.layout == "padded":
                packed = dataclasses.replace(tries[0][0], layout="packed")
                tries.append((packed, f"{truncate}, --dynamic-batch-layout packed"))
            fix = ""
            for candidate, words in tries:
                if _fits(candidate, spec, budget):
                    fix = f", or {words}"
                    break
                ranks = allowed if start_ranks else 0
                wider = _wider_dp(candidate, spec, budget, start_ranks, ranks)
                if wider is not None:
                    fix = f", or {words} and --dp-size {wider}"
                    break
            rest = sum(spec.lengths) - longest
            about = MAX_COMPUTED_TOKENS_PER_RANK * dp // 2
            if not fix and rest > about:
                fix = (
                    f"; the other samples ({rest} tokens) are more than a rank runs too: verify "
                    f"fewer samples (about {about} tokens at --dp-size {dp})"
                )
            raise DynBatchValueError(
                f"{ran}; a sample of {longest} tokens alone is more than that: leave it out of "
                f"SAMPLES.json or shorten it{fix} (verify checks the batching, which samples of "
                "a few thousand tokens show as well)."
            )
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
        wider = _wider_dp(config, spec, budget, start_ranks, allowed if start_ranks else 0)
        if wider is not None:
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
        plan = run_planner(samples, config)
    return sum(
        step.num_microbatches * step.micro_batch_size * step.seq_length for step in plan.steps
    )


def _wider_dp(
    config: PlannerConfig, spec: VerifySpec, budget: Optional[int], start_ranks: bool, allowed: int
) -> Optional[int]:
    """A ``--dp-size`` at which ``config`` plans ``spec``'s samples within what a rank runs (and
    this machine starts the ranks), or ``None``."""
    try:
        per_rank = _computed_per_rank(config, spec)
    except ValueError:
        return None
    parallel = config.parallel
    wider = math.ceil(per_rank * parallel.dp_size / MAX_COMPUTED_TOKENS_PER_RANK) + 1
    others = spec.world_size // parallel.dp_size
    if start_ranks and wider * others > allowed:
        return None
    wide = dataclasses.replace(config, parallel=dataclasses.replace(parallel, dp_size=wider))
    return wider if _fits(wide, spec, budget) else None


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
        plan = run_planner(SampleSet.build(spec.lengths, spec.rollouts, spec.prompts), config)
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
