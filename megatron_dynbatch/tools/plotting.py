"""Drawing one planned step: what each micro-batch holds, and the simulated pipeline timeline.

``megatron-dynbatch plan --plot FILE.png`` calls :func:`plot_step`. matplotlib is imported inside
the function (Agg canvas, no global backend switch), so importing the planner or the CLI never pulls
it in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import Plan, PlannerConfig, SampleSet
from megatron_dynbatch.planning.cost import step_microbatch_costs
from megatron_dynbatch.planning.simulate import (
    BACKWARD_TO_FORWARD_RATIO,
    SimResult,
    simulate_interleaved,
)

__all__ = ["DEFAULT_MAX_RANKS", "StepPicture", "microbatch_costs", "plot_step"]

#: DP ranks drawn in the top panel; beyond it the bars get thinner than a pixel at figure width.
DEFAULT_MAX_RANKS = 16

_REAL_COLOR = "#3b75af"
_PADDING_COLOR = "#c9c9c9"
_PLACEHOLDER_COLOR = "#ef8636"
_FORWARD_COLOR = "#4c8cc4"
_BACKWARD_COLOR = "#e07b39"


@dataclass(frozen=True)
class StepPicture:
    """What :func:`plot_step` drew, so that tests (and callers) can check the picture's data."""

    ranks: Tuple[int, ...]
    """The DP ranks drawn in the top panel."""
    bars: Tuple[Tuple[int, int, int, int, int], ...]
    """One per drawn micro-batch: ``(rank, m, real tokens, padding, placeholder)`` in tokens."""
    token_cap: int
    """The cap line."""
    timeline: SimResult
    """DP rank 0's simulated pipeline (bottom panel)."""


def microbatch_costs(
    plan: Plan, step_index: int, samples: SampleSet, config: PlannerConfig, dp_rank: int
) -> List[float]:
    """Forward cost of each micro-batch of one DP rank, as the planner scores it.

    The one cost model of :mod:`megatron_dynbatch.planning.cost` (linear work on every position of
    the ``[B, S]`` row, attention per segment with the packed padding tail in short segments of
    its own, response work, per-micro-batch overhead).
    """
    return step_microbatch_costs(
        plan.steps[step_index],
        layout=plan.layout,
        lengths=samples.lengths,
        prompt_lengths=samples.prompt_lengths,
        sample_multiple=plan.sample_multiple,
        model=config.cost,
    )[dp_rank]


def _bar_parts(
    plan: Plan, step_index: int, samples: SampleSet, ranks: Sequence[int]
) -> Tuple[List[float], List[int], List[int], List[int], List[Tuple[float, str]]]:
    """x positions and (real, padding, placeholder) heights of every drawn micro-batch bar."""
    step = plan.steps[step_index]
    kept = dict(step.kept_lengths)  # samples the truncate policy cut: only their kept tokens run
    footprint = step.micro_batch_size * step.seq_length
    gap = max(1, step.num_microbatches // 4)  # blank slots between two ranks' groups
    xs: List[float] = []
    real: List[int] = []
    padding: List[int] = []
    placeholder: List[int] = []
    ticks: List[Tuple[float, str]] = []
    for k, r in enumerate(ranks):
        base = k * (step.num_microbatches + gap)
        for m, mb in enumerate(step.ranks[r]):
            xs.append(base + m)
            tokens = sum(kept.get(i, samples.lengths[i]) for i in mb)
            real.append(tokens)
            padding.append(footprint - tokens if mb else 0)
            placeholder.append(0 if mb else footprint)
        ticks.append((base + (step.num_microbatches - 1) / 2.0, str(r)))
    return xs, real, padding, placeholder, ticks


def _draw_timeline(
    ax, result: SimResult, pp_size: int, vpp_size: int, num_microbatches: int
) -> None:
    label_events = num_microbatches * vpp_size <= 32  # numbers stay legible up to ~32 boxes a row
    for event in result.events:
        color = _FORWARD_COLOR if event.kind == "F" else _BACKWARD_COLOR
        # Later model chunks are drawn lighter so the interleaving order is visible.
        alpha = 1.0 - 0.5 * event.chunk / max(1, vpp_size - 1) if vpp_size > 1 else 1.0
        ax.barh(
            event.stage,
            event.end - event.start,
            left=event.start,
            height=0.8,
            color=color,
            alpha=alpha,
            edgecolor="white",
            linewidth=0.4,
        )
        if label_events and event.end > event.start:
            ax.text(
                (event.start + event.end) / 2.0,
                event.stage,
                str(event.microbatch),
                ha="center",
                va="center",
                fontsize=6,
                color="black",
            )
    ax.set_yticks(range(pp_size))
    ax.set_yticklabels([f"stage {s}" for s in range(pp_size)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan * 1.01 if result.makespan > 0 else 1.0)
    ax.set_xlabel(
        "simulated time (cost units: forward = cost model, backward = "
        f"{BACKWARD_TO_FORWARD_RATIO:g} x forward)"
    )


def plot_step(
    plan: Plan,
    step_index: int,
    samples: SampleSet,
    config: PlannerConfig,
    path: str,
    *,
    max_ranks: int = DEFAULT_MAX_RANKS,
) -> StepPicture:
    """Draw one step of ``plan`` to a PNG at ``path``, and return what it drew.

    Top: one bar per micro-batch, grouped by DP rank (the first ``max_ranks`` ranks), stacked as
    real tokens, padding up to the step's ``micro_batch_size * seq_length`` and placeholder rows; a
    line marks the token cap. Bottom: DP rank 0's pipeline simulated with Megatron's 1F1B or
    interleaved order (``planning/simulate.py``) from the cost model, one row per stage, F/B boxes
    per micro-batch.

    Returns:
        The drawn data (:class:`StepPicture`).

    Raises:
        ValueError: ``step_index`` outside the plan, or ``max_ranks`` < 1.
    """
    if not 0 <= step_index < len(plan.steps):
        raise DynBatchValueError(
            f"step_index={step_index} is outside the plan's {len(plan.steps)} step(s); pass 0 to "
            f"{len(plan.steps) - 1}."
        )
    if max_ranks < 1:
        raise DynBatchValueError(f"max_ranks={max_ranks} must be >= 1.")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    step = plan.steps[step_index]
    parallel = config.parallel
    dp = len(step.ranks)
    drawn = list(range(min(dp, max_ranks)))

    fig = Figure(figsize=(12, 7.5), dpi=110)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [1.15, 1.0]})

    xs, real, padding, placeholder, ticks = _bar_parts(plan, step_index, samples, drawn)
    width = 0.85
    top.bar(xs, real, width, color=_REAL_COLOR, label="real tokens")
    top.bar(xs, padding, width, bottom=real, color=_PADDING_COLOR, label="padding")
    top.bar(xs, placeholder, width, color=_PLACEHOLDER_COLOR, hatch="//", label="placeholder")
    top.axhline(plan.token_cap, color="#b22222", linestyle="--", linewidth=1.0)
    top.set_xticks([x for x, _ in ticks])
    top.set_xticklabels([label for _, label in ticks], fontsize=7 if len(ticks) > 8 else 9)
    top.set_xlabel("DP rank (one bar per micro-batch, in schedule order)")
    top.set_ylabel("tokens per micro-batch")
    top.set_ylim(0, max(plan.token_cap, step.micro_batch_size * step.seq_length) * 1.08)
    shown = f"all {dp} DP ranks" if len(drawn) == dp else f"DP ranks 0-{len(drawn) - 1} of {dp}"
    top.set_title(
        f"step {step_index}: {plan.layout}, M={step.num_microbatches}/rank, "
        f"S={step.seq_length}, B={step.micro_batch_size}, fill {step.fill:.3f}, "
        f"DP imbalance {step.dp_imbalance:.3f} (tokens) / {step.dp_imbalance_cost:.3f} (cost), "
        f"{step.num_placeholders} placeholders; {shown}",
        fontsize=9,
    )
    handles = [
        Patch(color=_REAL_COLOR, label="real tokens"),
        Patch(color=_PADDING_COLOR, label="padding"),
        Patch(facecolor=_PLACEHOLDER_COLOR, hatch="//", label="placeholder"),
        top.get_lines()[0],
    ]
    handles[-1].set_label(f"token cap {plan.token_cap}")
    top.legend(handles=handles, loc="upper right", fontsize=8, ncol=4, framealpha=0.9)

    fwd = microbatch_costs(plan, step_index, samples, config, 0)
    bwd = [BACKWARD_TO_FORWARD_RATIO * c for c in fwd]
    result = simulate_interleaved(
        fwd, bwd, parallel.pp_size, parallel.vpp_size, parallel.microbatch_group_size_per_vp_stage
    )
    _draw_timeline(bottom, result, parallel.pp_size, parallel.vpp_size, step.num_microbatches)
    schedule = "interleaved" if parallel.vpp_size > 1 else "1F1B"
    bottom.set_title(
        f"DP rank 0 pipeline ({schedule}, pp={parallel.pp_size}, vpp={parallel.vpp_size}): "
        f"makespan {result.makespan:.4g}, bubble {result.bubble_fraction:.1%} of stage time"
        + ("; later model chunks drawn lighter" if parallel.vpp_size > 1 else ""),
        fontsize=9,
    )
    bottom.legend(
        handles=[
            Patch(color=_FORWARD_COLOR, label="forward"),
            Patch(color=_BACKWARD_COLOR, label="backward"),
        ],
        loc="upper right",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, format="png")
    bars = []
    k = 0
    for r in drawn:
        for m in range(step.num_microbatches):
            bars.append((r, m, real[k], padding[k], placeholder[k]))
            k += 1
    return StepPicture(
        ranks=tuple(drawn), bars=tuple(bars), token_cap=plan.token_cap, timeline=result
    )
