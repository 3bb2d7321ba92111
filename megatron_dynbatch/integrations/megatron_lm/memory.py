"""``--max-memory-gib`` in Megatron-LM: the memory model from Megatron's arguments, the budget,
the start-up check, and every step's peak, measured and compared with the prediction.

* :func:`memory_model_from_args`: the pure memory model (:mod:`megatron_dynbatch.planning.memory`)
  of the run, from Megatron's own arguments (``model_args.py``: its defaults applied as
  ``validate_args`` would, so it works before Megatron's validation).
* :func:`budget_bytes`: ``--max-memory-gib`` in bytes; ``auto`` is the GPU's memory less
  :data:`AUTO_MARGIN` (10%) of it, and on CPU this rank's share of the machine's available memory
  (``MemAvailable`` / ranks on the node) less the same margin.
* :func:`check_memory_budget`: at start-up, before the model is built, a budget below what one
  ``--seq-length`` sample needs on some pipeline stage is refused in one line naming the fix.
* :class:`StepMemory`: each training step's measured peak. GPU: ``torch.cuda.max_memory_allocated``
  after ``reset_peak_memory_stats`` at the step's start (what the caching allocator hands to
  tensors); CPU: the process's peak resident memory (``VmHWM`` of ``/proc/self/status``, reset by
  writing ``5`` to ``/proc/self/clear_refs`` at the step's start). The readings of every rank are
  gathered (one small all-reduce over the world), so every rank refits the same model from the
  same numbers and plans the same steps; a step whose measured peak exceeds the budget although
  predicted within it is reported on every rank and the fit is corrected to cover it.
* :class:`TrainingPeak`: the run's training peak, for fixed micro-batches too (the equal-bytes
  comparisons take the fixed run's as the dynamic run's budget).

How the planner's model learns (:class:`StepMemory`): the first step is a probe (rows of
``--seq-length``); its peak sets a factor on the counted activation bytes that covers it, one-time
costs included; from the second step on, one factor a stage is fitted by least squares to the
recent steps (peak less the memory at the step's start), never below what the largest of them
needed, and a step may keep at most :data:`TRUST_GROWTH` times the largest activations measured
so far. Memory at rest is what every stage held after the last step.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.model_args import memory_model_from_flags
from megatron_dynbatch.planning.memory import (
    GIB,
    MIB,
    UNFITTED_SAFETY,
    MemoryLimit,
    MemoryModel,
    MicroShape,
    PeakTerms,
    budget_gib,
    fit_activation_scale,
    fit_peak_line,
    gib_to_bytes,
)
from megatron_dynbatch.planning.spec import ParallelLayout, round_up

__all__ = [
    "AUTO_MARGIN",
    "StepMemory",
    "TrainingPeak",
    "budget_bytes",
    "check_memory_budget",
    "memory_model_from_args",
    "process_memory_now",
]

#: ``--max-memory-gib auto`` keeps this share of the device's memory free: allocator
#: fragmentation, NCCL buffers and the CUDA context are outside ``max_memory_allocated``.
AUTO_MARGIN = 0.10
#: The smallest ``--max-memory-gib`` a start-up refusal names is this much over the predicted
#: need on a GPU (tensors only: the estimate of weights, gradients and optimizer state is close),
#: so that the named value passes the check again and holds through the first steps.
STARTUP_MARGIN = 0.05
#: The same on CPU, where the need is the process's resident set, which grows after the check
#: (model, optimizer and data built): issue 44's test, pp 2, predicted 383 MiB at start-up, then
#: measured 412-416 MiB at the first steps and refitted one --seq-length row at 433-435 MiB; at
#: +5% (402 MiB) the run trained but over the budget, said; +20% (460 MiB) holds.
CPU_STARTUP_MARGIN = 0.20
#: Steps at the start of a run whose peaks are not fitted: the first step allocates the
#: optimizer's state (not yet in the memory at rest), and allocator caches settle.
MEMORY_WARMUP_STEPS = 1
#: A step may keep at most this many times the largest activations (as counted) measured so far:
#: 2, so that rows of whole samples can double (1.5 kept a corpus of --seq-length samples at one
#: sample a micro-batch for good: no step ever measured two).
TRUST_GROWTH = 2.0
#: Steps whose counted activations are at least this share of the largest in the fit window
#: bound the factor from below (their measured need is never under-predicted again).
ENVELOPE_SHARE = 0.5
#: A step on CPU (``StepMemory.resident``) is a point of its stage's line only where its peak is
#: more than this share over what it started with (else the peak measured the heap kept).
RESIDENT_GROWTH = 0.005
#: Steps of measured peaks a fit uses (the most recent).
FIT_WINDOW = 16
#: On CPU (``StepMemory.resident``) a shape no step has measured is planned within the budget
#: less this share: the resident set of one shape varies by 2-3.5% from step to step, so a line
#: raised over a few steps still under-predicted a longer shape (the demo's fresh clones, fixed's
#: peak as the budget: [4 x 277] after [4 x 256] predicted 466 MiB, measured 478 of 474; the run's
#: peak 1% over fixed's twice in three runs). Shapes measured within the budget still fit.
RESIDENT_JITTER = 0.03


def process_memory_now() -> float:
    """What this process holds now, in the units the step's peak is measured in (bytes)."""
    if torch.cuda.is_available():
        return float(torch.cuda.memory_allocated())
    return float(_proc_status_kib("VmRSS") * 1024)


def memory_model_from_args(
    args: Any, parallel: ParallelLayout, attention: str, *, vocab_size: Optional[int] = None
) -> MemoryModel:
    """The run's :class:`MemoryModel`, before the memory fit.

    ``base_bytes`` is what the process holds before the model exists (on CPU the interpreter,
    torch and megatron, read now; on a GPU 0, since ``max_memory_allocated`` counts tensors only).
    """
    if vocab_size is None and not getattr(args, "padded_vocab_size", None):
        vocab_size = getattr(args, "vocab_size", None) or _tokenizer_vocab_size()
    return memory_model_from_flags(
        args,
        parallel,
        attention,
        vocab_size=vocab_size,
        base_bytes=0.0 if torch.cuda.is_available() else process_memory_now(),
    )


def _tokenizer_vocab_size() -> Optional[int]:
    """The built tokenizer's vocabulary (the patched parse builds it with the arguments)."""
    try:
        from megatron.training import get_tokenizer

        return int(get_tokenizer().vocab_size)
    except Exception:  # noqa: BLE001 - none built: model_args assumes a GPT-2 vocabulary
        return None


def budget_bytes(max_memory_gib: Any) -> int:
    """``--max-memory-gib`` in bytes (``auto``: see the module docstring)."""
    return resolve_budget(max_memory_gib)[0]


def resolve_budget(max_memory_gib: Any) -> Tuple[int, str]:
    """``--max-memory-gib`` in bytes and where the figure comes from, in words (the start-up
    line: ``auto`` names the memory it read and the margin it left)."""
    if max_memory_gib == "auto":
        if torch.cuda.is_available():
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            where = f"the device's {total / MIB:.0f} MiB"
        else:
            ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
            total = _proc_meminfo_kib("MemAvailable") * 1024 / max(1, ranks)
            where = (
                f"MemAvailable's share of this rank ({ranks} local ranks), {total / MIB:.0f} MiB,"
            )
        return (
            int(total * (1.0 - AUTO_MARGIN)),
            f"--max-memory-gib auto: {where} less the {100 * AUTO_MARGIN:.0f}% margin",
        )
    return gib_to_bytes(max_memory_gib), f"--max-memory-gib {max_memory_gib}"


#: How the messages name the longest row a sample can have: ``--seq-length``'s.
SEQ_LENGTH_ROW = "--seq-length"


def check_memory_budget(
    limit: MemoryLimit, seq_length: Optional[int], flag: str, row: str = SEQ_LENGTH_ROW
) -> None:
    """Refuse, before the model is built, a budget one ``--seq-length`` sample cannot fit under
    (``seq_length``: the longest row a sample can have; ``row`` names where it comes from, e.g.
    the token budget samples are cut to under ``--oversize-samples truncate``).

    ``limit`` carries the model the first step plans with (:attr:`StepMemory.current` before any
    step: counted activations times :data:`UNFITTED_SAFETY`) and its row multiple, so the
    arithmetic is the first step's: the smallest budget named here is one that starts and trains
    (issue 44: a minimum checked without the factor was refused again at the first step).

    Raises:
        DynBatchValueError: One line with the stage, the bytes predicted and the fixes.
    """
    model = limit.model
    length = int(seq_length or limit.row_multiple)
    stage, need = model.worst_stage((1, round_up(length, limit.row_multiple)))
    if need > limit.budget_bytes:
        rest = model.resting(stage)
        # With a margin for what the estimate misses (see STARTUP_MARGIN); rounded up, so the
        # named value passes this check again.
        margin = STARTUP_MARGIN if torch.cuda.is_available() else CPU_STARTUP_MARGIN
        smallest = budget_gib(need, margin)
        # Only the fixes that are left: recomputation the run already does is no advice, and
        # nothing but a larger budget helps when what is held at rest alone is over it.
        fixes = [f"raise {flag} to at least {smallest:.3f}"]
        if rest >= limit.budget_bytes:
            fixes[0] += " (what is held at rest alone is over it)"
        else:
            recompute = {None: "selective / full", "selective": "full"}.get(model.recompute)
            if recompute:
                fixes.append(f"recompute activations (--recompute-granularity {recompute})")
            fixes.append(f"lower {row.split()[0]}")
        raise DynBatchValueError(
            f"{flag} {limit.budget_bytes / GIB:.3f} is too small for one {row} "
            f"{length} sample: pipeline stage {stage} is predicted to hold "
            f"{need / GIB:.3f} GiB at its peak ({rest / GIB:.3f} GiB of weights, gradients, "
            f"optimizer state and process at rest, the rest activations of the micro-batches "
            f"its schedule keeps alive, counted x{UNFITTED_SAFETY:g} until measured); "
            + (", ".join(fixes[:-1]) + ", or " + fixes[-1] if len(fixes) > 1 else fixes[0])
            + "."
        )


def _proc_status_kib(key: str) -> int:
    return _proc_kib("/proc/self/status", key, "cannot measure memory here")


def _proc_meminfo_kib(key: str) -> int:
    return _proc_kib("/proc/meminfo", key, "pass --max-memory-gib in GiB")


def _proc_kib(path: str, key: str, fix: str) -> int:
    """The ``key:`` line of a ``/proc`` file, in KiB; refused, naming ``fix``, where it lacks it."""
    with open(path, encoding="ascii") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise DynBatchValueError(f"{path} has no {key}; {fix}.")


def _reset_peak() -> float:
    """Start measuring a step: the peak is reset to what is held now, which is returned."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return float(torch.cuda.memory_allocated())
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")  # resets VmHWM to the current resident set
    return float(_proc_status_kib("VmRSS") * 1024)


def _read_peak() -> float:
    if torch.cuda.is_available():
        return float(torch.cuda.max_memory_allocated())
    return float(_proc_status_kib("VmHWM") * 1024)


@dataclass
class _Reading:
    """One step as predicted on this rank's stage, and as measured."""

    iteration: Optional[int]
    """Megatron's number of the iteration (as its iteration line prints it)."""
    predicted: List[PeakTerms]
    """Per stage."""
    rest: float
    """What this rank held when the step started (its peak was reset to it)."""
    shape: Optional[MicroShape] = None
    """The one shape of every micro-batch on every DP rank, where the step had one and enough
    micro-batches for every stage to hold its most live ones; ``None`` otherwise."""
    peak: Optional[float] = None
    gathered: Optional[List[Tuple[float, float, float]]] = None
    """Per pipeline stage, ``(rest, peak, after)`` (``after``: held when the step was read):
    the largest over the stage's ranks."""


@dataclass
class StepMemory:
    """Every training step's peak memory: measured, gathered, compared and fitted (one a run).

    The planner's model (:attr:`current`) takes what every stage held after the last step as its
    memory at rest (on CPU the resident set keeps growing over the first steps, as the heap keeps
    what it freed), and the per-token / per-``S**2`` factors fitted to the steps measured so far
    (:func:`~megatron_dynbatch.planning.memory.fit_activation_scale`), or before a fit the counted
    bytes times :data:`~megatron_dynbatch.planning.memory.UNFITTED_SAFETY`. The first step is a
    probe: planned in micro-batches
    of one ``--seq-length`` row at most, as it also pays one-time costs (the optimizer's state,
    the first allocations of every kernel) no model predicts.
    """

    model: MemoryModel
    """The model as built from the arguments (counted bytes, no fit)."""
    budget: Optional[int]
    """``--max-memory-gib`` in bytes, or ``None`` (measured and predicted, not bounded)."""
    row_multiple: int = 1
    min_row: int = 1
    """``--seq-length`` (under ``--oversize-samples truncate`` at most the token budget samples
    are cut to): the probe step's row, and the row any budget must leave room for."""
    min_row_name: str = SEQ_LENGTH_ROW
    """Where :attr:`min_row` comes from, as the messages name it."""
    scales: Optional[Tuple[Tuple[float, float], ...]] = None
    """Per stage, the fitted ``(token_scale, score_scale)``; ``None`` before a fit."""
    resting: Optional[Tuple[float, ...]] = None
    """Per stage, what its ranks held (at most) after the last step; ``None`` before any."""
    error: Optional[float] = None
    """Largest relative error of the fitted model's peak over the steps it was fitted to."""
    observations: List[Tuple[int, float, float, float, float]] = field(default_factory=list)
    """``(stage, tokens, scores, rest, peak)`` of every fitted step and stage."""
    steps_seen: int = 0
    stage: int = 0
    """This rank's pipeline stage."""
    open: Optional[_Reading] = None
    last: Optional[_Reading] = None
    corrections: int = 0
    """Steps whose measured peak exceeded the budget although predicted within it."""
    stage_peaks: List[float] = field(default_factory=list)
    """Per pipeline stage, the largest peak measured over the run's training steps."""
    warned_small: bool = False
    writers: Optional[Tuple[Any, Any, int]] = None
    """Megatron's TensorBoard and W&B writers (on the rank that holds them) and the iteration
    whose scalars Megatron has just written (every ``--tensorboard-log-interval``): that step's
    memory scalars follow when the step is read, at the same iteration; other steps' are not
    written."""
    largest_counted: Dict[int, Tuple[float, float]] = field(default_factory=dict)
    """Per stage, the largest counted token and score bytes of a measured step."""
    cover_floor: Dict[int, float] = field(default_factory=dict)
    """Per stage, the factor the steps that broke the budget needed (the fit stays above)."""
    resident: bool = False
    """The peak is the process's resident set (CPU): what a step starts with holds the heap the
    last steps freed, which this step's activations reuse, so "at rest plus a factor" counts it
    twice (the e2e mix at pp 2: predicted 7-11% over the measured, so at the fixed run's measured
    peak the planner refused fixed's own [4 x 256], which measured 503-516 MiB under budgets of
    517-533). Each stage's peak is then a line through the steps' absolute peaks
    (:func:`~megatron_dynbatch.planning.memory.fit_peak_line`) where the steps place one."""
    intercepts: Optional[Tuple[Optional[float], ...]] = None
    """Per stage, the fitted line's intercept (``resident``), ``None`` where the steps place no
    line (the memory at rest is used)."""
    over_steps: List[Tuple[int, float, float]] = field(default_factory=list)
    """``(stage, counted, peak)`` of every step that broke the budget: every line covers them."""
    within: List[MicroShape] = field(default_factory=list)
    """Shapes steps ran within the budget on every stage, as measured (the largest ones):
    :attr:`MemoryLimit.measured`."""

    @property
    def pp_size(self) -> int:
        return self.model.dims.parallel.pp_size

    @property
    def current(self) -> MemoryModel:
        """The model the planner and the prediction use (see the class docstring)."""
        model = self.model
        if self.resting is not None:
            resting = self.resting
            if self.intercepts is not None:
                resting = tuple(
                    rest if line is None else line
                    for rest, line in zip(resting, self.intercepts, strict=True)
                )
            model = replace(model, resting_bytes=resting)
        if self.scales is not None:
            return replace(model, stage_scales=self.scales)
        return replace(
            model,
            token_scale=model.token_scale * UNFITTED_SAFETY,
            score_scale=model.score_scale * UNFITTED_SAFETY,
        )

    def limit(self) -> Optional[MemoryLimit]:
        """The budget the planner keeps to, with the memory model as fitted so far.

        The probe step (the first) and any step the measured model says cannot hold one
        ``--seq-length`` row within the budget run rows of ``--seq-length`` at most: the budget
        is then what such rows are predicted to need (said once, on rank 0), never a plan that
        refuses the run's own samples. On CPU (:attr:`resident`) a shape no step has measured
        is planned within the budget less :data:`RESIDENT_JITTER`.
        """
        if self.budget is None:
            return None
        model = self.current
        need = self._row_peak(model)
        budget = self.budget
        caps: Tuple[Tuple[float, float], ...] = ()
        if self.steps_seen == 0 or need > budget:
            # The probe step (the first) runs rows of --seq-length: the start-up check
            # (check_memory_budget) passed this arithmetic with the model's estimated memory at
            # rest; measured, that may be more, which is said, never refused (issue 44).
            if need > budget and not self.warned_small:
                self.warned_small = True
                if not dist.is_initialized() or dist.get_rank() == 0:
                    print(
                        f"dynamic batching: as measured, one {self.min_row_name} {self.min_row} row "
                        f"needs {need / MIB:.0f} MiB on some pipeline stage, over "
                        f"--max-memory-gib {self.budget / GIB:.3f} ({self.budget / MIB:.0f} "
                        "MiB): planning micro-batches of such rows at most; raise "
                        "--max-memory-gib, recompute activations or lower "
                        f"{self.min_row_name.split()[0]}.",
                        flush=True,
                    )
            budget = need
            measured: Tuple[MicroShape, ...] = ()
        else:
            caps = self._trusted(model)
            measured = tuple(self.within)
            if self.resident:
                # Never below what one --seq-length row needs (checked above): rows of it plan.
                budget = max(int(budget * (1.0 - RESIDENT_JITTER)), need)
        return MemoryLimit(
            model=model,
            budget_bytes=budget,
            row_multiple=self.row_multiple,
            counted_caps=caps,
            measured=measured,
        )

    def _trusted(self, model: MemoryModel) -> Tuple[Tuple[float, float], ...]:
        """Per stage, :data:`TRUST_GROWTH` times the largest token and score bytes measured so
        far (as counted, over the worst case of a step's live micro-batches), never below one
        ``--seq-length`` row: the fit is a line through a few steps, and a step far beyond them
        broke the budget by 4-6% on CPU (one row of 603 after rows of 2 x 256: 2.8x the scores,
        whose transients cost more than the tokens' for the one factor fitted)."""
        row = (1, round_up(self.min_row, self.row_multiple))
        caps = []
        for s in model.dims.stages():
            tok, sq = model.uniform_terms(s, row)
            seen_tok, seen_sq = self.largest_counted.get(s, (0.0, 0.0))
            caps.append((max(TRUST_GROWTH * seen_tok, tok), max(TRUST_GROWTH * seen_sq, sq)))
        return tuple(caps)

    def _row_peak(self, model: MemoryModel) -> int:
        """The largest predicted peak of micro-batches of one ``--seq-length`` row."""
        row = (1, round_up(self.min_row, self.row_multiple))
        return int(math.ceil(model.worst_stage(row)[1]))

    def before_plan(self, stage: int, group: Any) -> None:
        """A training step is about to be planned (every rank calls this at the same point):
        close the last step (gather, refit); before the first, measure what every stage holds
        now, so even the first plan starts from measured memory, not an estimate."""
        self.stage = stage
        self.close(group)
        if self.resting is None:
            gathered = _gather([process_memory_now()], stage, self.pp_size, group)
            shards = self.model.dims.parallel.dp_size if self.model.distributed_optimizer else 1
            # Adam's moments are created by the first optimizer step: not held yet.
            self.resting = tuple(
                now + self.model.dims.stage_params(s) * 8 / shards
                for s, (now,) in enumerate(gathered)
            )

    def begin(
        self,
        iteration: Optional[int],
        predicted: Sequence[PeakTerms],
        shapes: Sequence[Sequence[MicroShape]] = (),
    ) -> None:
        """A training step is about to run (after its plan): reset the peak. ``shapes``: every DP
        rank's micro-batch shapes (where given, a step of one shape that stays within the budget
        lets that shape through from then on: :attr:`within`)."""
        self.open = _Reading(
            iteration=iteration,
            predicted=list(predicted),
            rest=_reset_peak(),
            shape=self._one_shape(shapes),
        )

    def _one_shape(self, shapes: Sequence[Sequence[MicroShape]]) -> Optional[MicroShape]:
        """The step's one micro-batch shape, where every stage ran its most live micro-batches
        of it (so its peak is what any step of that shape holds at most), else ``None``."""
        flat = {shape for rank in shapes for shape in rank}
        if len(flat) != 1 or not shapes:
            return None
        parallel = self.model.dims.parallel
        if min(len(rank) for rank in shapes) < parallel.group_size * (parallel.pp_size + 1):
            return None  # too few for the schedule's warm-up to keep its most alive
        return next(iter(flat))

    def pause(self) -> None:
        """An evaluation is about to run: the open step's peak is read now, without it."""
        if self.open is not None and self.open.peak is None:
            self.open.peak = _read_peak()

    def close(self, group: Any) -> Optional[_Reading]:
        """Read and gather the open step (every rank calls this at the same point)."""
        reading = self.open
        if reading is None:
            return self.last
        if reading.peak is None:
            reading.peak = _read_peak()
        values = [reading.rest, reading.peak, process_memory_now()]
        reading.gathered = _gather(values, self.stage, self.pp_size, group)
        peaks = [peak for _, peak, _ in reading.gathered]
        self.stage_peaks = [
            max(a, b) for a, b in zip(self.stage_peaks or peaks, peaks, strict=True)
        ]
        self.resting = tuple(after for _, _, after in reading.gathered)
        self._learn(reading)
        self.open, self.last = None, reading
        self._write(reading)
        return reading

    def _write(self, reading: _Reading) -> None:
        """The step's scalars to Megatron's writers, at the step's iteration (the writers take
        them after Megatron's own: the step is read after its scalars are written)."""
        if self.writers is None or reading.iteration is None:
            return
        writer, wandb_writer, iteration = self.writers
        if reading.iteration != iteration:
            return
        values = self.scalars(reading)
        if writer is not None:
            for tag, value in values.items():
                writer.add_scalar(tag, value, reading.iteration)
        if wandb_writer is not None:
            wandb_writer.log(values, reading.iteration)

    def _learn(self, reading: _Reading) -> None:
        self.steps_seen += 1
        for stage, terms in enumerate(reading.predicted):
            tok, sq = self.largest_counted.get(stage, (0.0, 0.0))
            self.largest_counted[stage] = (max(tok, terms.tokens), max(sq, terms.scores))
        over = []
        # Planned within the budget: as predicted, or as a shape measured within it (within).
        measured = reading.shape is not None and any(
            reading.shape[0] <= b and reading.shape[1] <= s for b, s in self.within
        )
        if self.budget is not None:
            for stage, (_rest, peak, _after) in enumerate(reading.gathered):
                if peak > self.budget and (
                    measured or reading.predicted[stage].total <= self.budget
                ):
                    over.append((stage, peak, reading.predicted[stage].total))
        if self.budget is not None and reading.shape is not None:
            self._measured_shape(reading.shape, fits=not over and self._all_within(reading))
        if self.steps_seen > MEMORY_WARMUP_STEPS:
            for stage, (rest, peak, _after) in enumerate(reading.gathered):
                terms = reading.predicted[stage]
                self.observations.append((stage, terms.tokens, terms.scores, rest, peak))
            self._fit()
        else:
            # The probe: one factor a stage that covers it, one-time costs included (so the
            # next step is planned on the safe side), until steps without them are fitted.
            self.scales = tuple(
                (k, k)
                for k in (
                    max(1.0, (peak - rest) / max(1.0, terms.tokens + terms.scores))
                    for (rest, peak, _), terms in zip(
                        reading.gathered, reading.predicted, strict=True
                    )
                )
            )
        if over:
            self.corrections += 1
            rank = dist.get_rank() if dist.is_initialized() else 0
            for stage, peak, predicted in over:
                planned = f"predicted {predicted / MIB:.0f} MiB"
                if predicted > self.budget:
                    rows, length = reading.shape
                    planned = f"a step of [{rows} x {length}] had measured within it ({planned})"
                print(
                    f"[rank {rank}] dynamic batching: iteration {reading.iteration}: pipeline "
                    f"stage {stage} measured {peak / MIB:.0f} MiB at its peak, over "
                    f"--max-memory-gib {self.budget / GIB:.3f} ({self.budget / MIB:.0f} MiB), "
                    f"although {planned}; the memory model is refitted to cover it.",
                    flush=True,
                )
            self._cover(reading)

    def _all_within(self, reading: _Reading) -> bool:
        return all(peak <= self.budget for _, peak, _ in reading.gathered)

    def _measured_shape(self, shape: MicroShape, fits: bool) -> None:
        """Keep the largest shapes measured within the budget; one measured over it takes back
        every kept shape at least as large (the measure is noisy near the budget)."""
        rows, length = shape
        if fits:
            if not any(rows <= b and length <= s for b, s in self.within):
                self.within = [
                    (b, s) for b, s in self.within if not (b <= rows and s <= length)
                ] + [shape]
        else:
            self.within = [(b, s) for b, s in self.within if not (b >= rows and s >= length)]

    def _fit(self) -> None:
        """Per stage, one factor on the counted activation bytes, least squares over the recent
        steps, and never below what a step that broke the budget needed (:meth:`_cover`).

        One factor for both terms: the counted bytes match what autograd keeps within a few
        percent for either (``tests/megatron/test_memory_megatron.py``); what the factor adds
        (the backward's gradients of activations, the allocator) grows with both alike, and
        a few noisy steps could not tell two factors apart.
        """
        recent = self.observations[-FIT_WINDOW * self.pp_size :]
        scales, errors, intercepts = [], [], []
        for stage in range(self.pp_size):
            own = [o for o in recent if o[0] == stage]
            # The largest step ever measured stays in the fit: the trust cap (_trusted) lets a
            # step keep twice its bytes, so the factor must still cover it once it has left the
            # window (a [4 x 256] step fitted at iteration 6 left it at 22; the factor fitted on
            # [2 x 256] steps alone then let [6 x 256] through, 13% over its prediction).
            largest_ever = max(
                (o for o in self.observations if o[0] == stage),
                key=lambda o: o[1] + o[2],
                default=None,
            )
            if largest_ever is not None and largest_ever not in own:
                own.append(largest_ever)
            line = self._line(stage, own) if self.resident else None
            intercepts.append(None if line is None else line[0])
            if line is not None:
                intercept, k = line
                scales.append((k, k))
                errors += [abs(intercept + k * (t + s) - peak) / peak for _, t, s, _, peak in own]
                continue
            k, _ = fit_activation_scale([(t, s, peak - rest) for _, t, s, rest, peak in own])
            # The largest steps seen are never under-predicted: on CPU the factor grew with
            # the step (1.85 fitted over small steps, 2.41 needed by one of 7 x 256 tokens).
            largest = max(t + s for _, t, s, _, _ in own)
            envelope = max(
                (
                    (peak - rest) / (t + s)
                    for _, t, s, rest, peak in own
                    if t + s > 0 and t + s >= ENVELOPE_SHARE * largest
                ),
                default=0.0,
            )
            k = max(k, envelope, self.cover_floor.get(stage, 0.0))
            scales.append((k, k))
            errors += [abs(rest + k * (t + s) - peak) / peak for _, t, s, rest, peak in own]
        self.scales = tuple(scales)
        self.intercepts = tuple(intercepts) if any(i is not None for i in intercepts) else None
        self.error = max(errors) if errors else None

    def _line(self, stage: int, own: Sequence[Tuple]) -> Optional[Tuple[float, float]]:
        """``(intercept, k)`` of stage ``stage``'s peaks as a line in the counted bytes
        (:attr:`resident`), raised to cover the steps it was fitted to, the largest steps and
        every step that broke the budget (as :meth:`_fit` covers them); ``None`` where the steps
        place no line."""
        # A step whose peak is what it started with measured the heap earlier steps left, not
        # its own need: not a point of the line (the largest steps still bound it below).
        grew = [o for o in own if o[4] > (1.0 + RESIDENT_GROWTH) * o[3]]
        fitted = fit_peak_line([(t + s, peak) for _, t, s, _, peak in grew])
        if fitted is None:
            return None
        intercept, k, _ = fitted
        # Raised over every step it was fitted to (the resident set of one shape varies by 2-3%
        # from step to step: a line through the middle planned [4 x 264] at 517 MiB under a
        # budget of 518, and it measured 529), the largest steps and every step that broke the
        # budget.
        largest = max(t + s for _, t, s, _, _ in own)
        covered = [(t + s, peak) for _, t, s, _, peak in own if t + s >= ENVELOPE_SHARE * largest]
        covered += [(t + s, peak) for _, t, s, _, peak in grew]
        covered += [(x, peak) for s, x, peak in self.over_steps if s == stage]
        intercept = max([intercept] + [peak - k * x for x, peak in covered])
        return intercept, k

    def _cover(self, reading: _Reading) -> None:
        """A step broke the budget: from now on every stage's factor covers what it needed."""
        for stage, (rest, peak, _after) in enumerate(reading.gathered):
            terms = reading.predicted[stage]
            counted = terms.tokens + terms.scores
            self.over_steps.append((stage, counted, peak))
            if counted > 0:
                need = (peak - rest) / counted
                self.cover_floor[stage] = max(self.cover_floor.get(stage, 0.0), need)
        if self.observations:
            self._fit()
        if self.scales is not None:
            lines = self.intercepts or (None,) * len(self.scales)
            # A stage with a line covers the step through it (_line); the others by the factor.
            self.scales = tuple(
                (
                    (a, b)
                    if line is not None
                    else (
                        max(a, self.cover_floor.get(s, 0.0)),
                        max(b, self.cover_floor.get(s, 0.0)),
                    )
                )
                for s, ((a, b), line) in enumerate(zip(self.scales, lines, strict=True))
            )

    def log_string(self, group: Any) -> str:
        """`` peak memory predicted/measured (MiB): P/M |`` of the step just run (a collective:
        every rank calls it where Megatron builds its iteration line)."""
        reading = self.close(group)
        if reading is None or reading.gathered is None:
            return ""
        predicted = max(t.total for t in reading.predicted)
        measured = max(peak for _, peak, _ in reading.gathered)
        line = (
            f" peak memory predicted/measured (MiB): {predicted / MIB:.0f}/{measured / MIB:.0f} |"
        )
        if self.budget is not None:
            line += f" memory budget (MiB): {self.budget / MIB:.0f} |"
        return line

    def scalars(self, reading: Optional[_Reading] = None) -> Dict[str, float]:
        """TensorBoard tags of a step's peaks (default: the last step read)."""
        reading = reading or self.last
        if reading is None or reading.gathered is None:
            return {}
        values = {
            "dynbatch/peak memory predicted (MiB)": max(t.total for t in reading.predicted) / MIB,
            "dynbatch/peak memory measured (MiB)": max(p for _, p, _ in reading.gathered) / MIB,
        }
        for stage, (_rest, peak, _after) in enumerate(reading.gathered):
            values[f"dynbatch/peak memory measured stage {stage} (MiB)"] = peak / MIB
            values[f"dynbatch/peak memory predicted stage {stage} (MiB)"] = (
                reading.predicted[stage].total / MIB
            )
        return values


def _gather(values: Sequence[float], stage: int, pp_size: int, group: Any) -> List[Tuple]:
    """Per pipeline stage, the largest of each of ``values`` over the ranks of that stage."""
    if not (dist.is_available() and dist.is_initialized()):
        return [tuple(values)] * pp_size
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    width = len(values) + 1
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )
    table = torch.zeros(width * world, dtype=torch.float64, device=device)
    table[width * rank : width * (rank + 1)] = torch.tensor([stage, *values], dtype=torch.float64)
    dist.all_reduce(table, group=group)
    per_stage = [tuple(0.0 for _ in values)] * pp_size
    rows = table.view(world, width).tolist()
    for row in rows:
        s = int(row[0])
        per_stage[s] = tuple(max(a, b) for a, b in zip(per_stage[s], row[1:], strict=True))
    return per_stage


class TrainingPeak:
    """The run's peak memory over its training steps, for fixed micro-batches too.

    Fixed micro-batches have no planned step to hook: the peak is reset at the first call of the
    forward step (model, optimizer and data loader built) and read when training returns, so it
    covers every training step as :class:`StepMemory`'s per-step peaks do for planned ones.
    Printed by rank 0 as ``peak memory measured over training (MiB): X | per stage: a, b``.
    """

    def __init__(self) -> None:
        self.started = False

    def wrap(self, forward_step: Any) -> Any:
        """``forward_step`` that starts the measurement at its first call."""

        def measured_forward_step(*args: Any, **kwargs: Any) -> Any:
            if not self.started:
                self.started = True
                _reset_peak()
            return forward_step(*args, **kwargs)

        return measured_forward_step

    def report(self, memory: Optional[StepMemory], stage: int, pp_size: int) -> List[float]:
        """Per stage, the largest peak over its ranks (a collective over the world)."""
        if memory is not None:
            memory.close(dist.group.WORLD)
            peaks = list(memory.stage_peaks)
        elif self.started:
            peaks = [peak for (peak,) in _gather([_read_peak()], stage, pp_size, dist.group.WORLD)]
        else:
            return []
        if peaks and (not dist.is_initialized() or dist.get_rank() == 0):
            print(
                f"peak memory measured over training (MiB): {max(peaks) / MIB:.1f} | per stage: "
                + ", ".join(f"{p / MIB:.1f}" for p in peaks),
                flush=True,
            )
            if memory is not None and memory.scales is not None:
                factors = ", ".join(f"{a:.2f}" for a, _ in memory.scales)
                error = "n/a" if memory.error is None else f"{100 * memory.error:.1f}%"
                print(
                    f"memory model: activation factor per stage {factors} (on the counted "
                    f"bytes); largest error of the fitted peaks {error} over the last "
                    f"{min(FIT_WINDOW, max(0, memory.steps_seen - MEMORY_WARMUP_STEPS))} steps; "
                    f"{memory.corrections} step(s) over the budget",
                    flush=True,
                )
        return peaks
