"""``--max-memory-gib`` in Megatron-LM: the memory model from Megatron's arguments, the budget,
the start-up check, and every step's peak, measured and compared with the prediction.

* :func:`model_dims_from_args` / :func:`memory_model_from_args`: the pure memory model
  (:mod:`megatron_dynbatch.planning.memory`) of the run, from Megatron's own arguments (its
  defaults applied as ``validate_args`` would, so it works before Megatron's validation).
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
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning.memory import (
    GIB,
    MIB,
    MemoryLimit,
    MemoryModel,
    PeakTerms,
    fit_activation_scales,
)
from megatron_dynbatch.planning.model_dims import ModelDims
from megatron_dynbatch.planning.spec import ParallelLayout, round_up

__all__ = [
    "AUTO_MARGIN",
    "StepMemory",
    "budget_bytes",
    "check_memory_budget",
    "memory_model_from_args",
    "model_dims_from_args",
    "process_memory_now",
]

#: ``--max-memory-gib auto`` keeps this share of the device's memory free: allocator
#: fragmentation, NCCL buffers and the CUDA context are outside ``max_memory_allocated``.
AUTO_MARGIN = 0.10
#: Steps at the start of a run whose peaks are not fitted: the first step allocates the
#: optimizer's state (not yet in the memory at rest), and allocator caches settle.
MEMORY_WARMUP_STEPS = 1
#: Steps of measured peaks a fit uses (the most recent).
FIT_WINDOW = 16


def _padded_vocab(args: Any, vocab_size: Optional[int]) -> int:
    padded = getattr(args, "padded_vocab_size", None)
    if padded:
        return int(padded)
    vocab = vocab_size or getattr(args, "vocab_size", None)
    if not vocab:
        try:
            from megatron.training import get_tokenizer

            vocab = get_tokenizer().vocab_size
        except Exception:  # noqa: BLE001 - no tokenizer built yet: a typical GPT vocabulary
            vocab = 50257
    multiple = (getattr(args, "make_vocab_size_divisible_by", None) or 128) * int(
        getattr(args, "tensor_model_parallel_size", None) or 1
    )
    return round_up(int(vocab), multiple)


def _ffn_hidden_size(args: Any) -> int:
    if getattr(args, "ffn_hidden_size", None):
        return int(args.ffn_hidden_size)
    if getattr(args, "swiglu", False):
        return int((4 * args.hidden_size * 2 / 3) / 64) * 64  # Megatron's validate_args
    return 4 * int(args.hidden_size)


def _params_dtype(args: Any) -> str:
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return "fp32"


def model_dims_from_args(
    args: Any, parallel: ParallelLayout, *, vocab_size: Optional[int] = None
) -> ModelDims:
    """:class:`ModelDims` of Megatron's arguments (before or after ``validate_args``)."""
    heads = int(args.num_attention_heads)
    groups = heads
    if getattr(args, "group_query_attention", False) and getattr(args, "num_query_groups", None):
        groups = int(args.num_query_groups)
    learned = getattr(args, "position_embedding_type", "learned_absolute") == "learned_absolute"
    experts = int(getattr(args, "num_experts", None) or 0)
    return ModelDims(
        num_layers=int(args.num_layers),
        hidden_size=int(args.hidden_size),
        num_attention_heads=heads,
        vocab_size=_padded_vocab(args, vocab_size),
        ffn_hidden_size=_ffn_hidden_size(args),
        num_query_groups=groups,
        kv_channels=getattr(args, "kv_channels", None) or None,
        gated_linear_unit=bool(getattr(args, "swiglu", False)),
        add_bias_linear=bool(getattr(args, "add_bias_linear", True)),
        normalization="RMSNorm" if getattr(args, "normalization", "") == "RMSNorm" else "LayerNorm",
        position_embeddings=(
            int(getattr(args, "max_position_embeddings", 0) or 0) if learned else 0
        ),
        untie_embeddings=bool(getattr(args, "untie_embeddings_and_output_weights", False)),
        params_dtype=_params_dtype(args),
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        num_experts=experts,
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None) or None,
        moe_router_topk=int(getattr(args, "moe_router_topk", None) or 2),
        ep_size=int(getattr(args, "expert_model_parallel_size", None) or 1) if experts else 1,
        parallel=parallel,
    )


def process_memory_now() -> float:
    """What this process holds now, in the units the step's peak is measured in (bytes)."""
    if torch.cuda.is_available():
        return float(torch.cuda.memory_allocated())
    return float(_proc_status_kib("VmRSS") * 1024)


def memory_model_from_args(
    args: Any, parallel: ParallelLayout, attention: str, *, vocab_size: Optional[int] = None
) -> MemoryModel:
    """The run's :class:`MemoryModel`, uncalibrated.

    ``base_bytes`` is what the process holds before the model exists (on CPU the interpreter,
    torch and megatron, read now; on a GPU 0, since ``max_memory_allocated`` counts tensors only).
    """
    recompute = getattr(args, "recompute_granularity", None)
    return MemoryModel(
        dims=model_dims_from_args(args, parallel, vocab_size=vocab_size),
        attention=attention,
        recompute=recompute if recompute in ("selective", "full") else None,
        distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
        base_bytes=0.0 if torch.cuda.is_available() else process_memory_now(),
    )


def budget_bytes(max_memory_gib: Any) -> int:
    """``--max-memory-gib`` in bytes (``auto``: see the module docstring)."""
    if max_memory_gib == "auto":
        if torch.cuda.is_available():
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        else:
            ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
            total = _proc_meminfo_kib("MemAvailable") * 1024 / max(1, ranks)
        return int(total * (1.0 - AUTO_MARGIN))
    return int(float(max_memory_gib) * GIB)


def check_memory_budget(limit: MemoryLimit, seq_length: Optional[int], flag: str) -> None:
    """Refuse, before the model is built, a budget one ``--seq-length`` sample cannot fit under.

    Raises:
        DynBatchValueError: One line with the stage, the bytes predicted and the fixes.
    """
    model = limit.model
    length = int(seq_length or limit.row_multiple)
    for stage in model.dims.stages():
        need = model.uniform_peak(stage, (1, round_up(length, limit.row_multiple)))
        if need > limit.budget_bytes:
            rest = model.resting(stage)
            raise DynBatchValueError(
                f"{flag} {limit.budget_bytes / GIB:.3f} is too small for one --seq-length "
                f"{length} sample: pipeline stage {stage} is predicted to hold "
                f"{need / GIB:.3f} GiB at its peak ({rest / GIB:.3f} GiB of weights, gradients, "
                f"optimizer state and process at rest, the rest activations of the micro-batches "
                f"its schedule keeps alive); raise {flag} to at least {need / GIB * 1.05:.2f}, "
                "recompute activations (--recompute-granularity selective / full), or lower "
                "--seq-length."
            )


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise DynBatchValueError(f"/proc/self/status has no {key}; cannot measure memory here.")


def _proc_meminfo_kib(key: str) -> int:
    with open("/proc/meminfo", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise DynBatchValueError(f"/proc/meminfo has no {key}; pass --max-memory-gib in GiB.")


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
    predicted: List[PeakTerms]
    """Per stage."""
    rest: float
    peak: Optional[float] = None
    gathered: Optional[List[Tuple[float, float]]] = None
    """Per pipeline stage, ``(rest, peak)``: the largest over the stage's ranks."""


@dataclass
class StepMemory:
    """Every training step's peak memory: measured, gathered, compared and fitted (one a run)."""

    model: MemoryModel
    """The model as built from the arguments (the fit is applied to it)."""
    budget: Optional[int]
    """``--max-memory-gib`` in bytes, or ``None`` (measured and predicted, not bounded)."""
    row_multiple: int = 1
    fitted: Optional[MemoryModel] = None
    """The calibrated model, once a step has been measured."""
    error: Optional[float] = None
    """Largest relative error of the fitted model's total peak over the steps it was fitted to."""
    observations: List[Tuple[int, float, float, float, float]] = field(default_factory=list)
    """``(stage, tokens, scores, rest, peak)`` of every fitted step and stage."""
    steps_seen: int = 0
    stage: int = 0
    """This rank's pipeline stage (set by :meth:`begin`)."""
    open: Optional[_Reading] = None
    last: Optional[_Reading] = None
    corrections: int = 0
    """Steps whose measured peak exceeded the budget although predicted within it."""

    @property
    def current(self) -> MemoryModel:
        return self.fitted or self.model

    def limit(self) -> Optional[MemoryLimit]:
        """The budget the planner keeps to, with the model as calibrated so far."""
        if self.budget is None:
            return None
        return MemoryLimit(
            model=self.current, budget_bytes=self.budget, row_multiple=self.row_multiple
        )

    def begin(
        self, iteration: Optional[int], predicted: Sequence[PeakTerms], stage: int, group: Any
    ) -> None:
        """A training step is about to run (after its plan): close the last one, reset the peak."""
        self.close(group)
        self.stage = stage
        self.open = _Reading(iteration=iteration, predicted=list(predicted), rest=_reset_peak())

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
        if reading.gathered is None:
            reading.gathered = _gather(
                reading.rest, reading.peak, self.stage, self.model.dims.parallel.pp_size, group
            )
            self._learn(reading)
        self.open, self.last = None, reading
        return reading

    def _learn(self, reading: _Reading) -> None:
        self.steps_seen += 1
        over = []
        if self.budget is not None:
            for stage, (_rest, peak) in enumerate(reading.gathered):
                if peak > self.budget and reading.predicted[stage].total <= self.budget:
                    over.append((stage, peak, reading.predicted[stage].total))
        if self.steps_seen <= MEMORY_WARMUP_STEPS:
            return
        for stage, (rest, peak) in enumerate(reading.gathered):
            terms = reading.predicted[stage]
            self.observations.append((stage, terms.tokens, terms.scores, rest, peak))
        self._fit()
        if over:
            self.corrections += 1
            for stage, peak, predicted in over:
                print(
                    f"[rank {dist.get_rank() if dist.is_initialized() else 0}] dynamic batching: "
                    f"iteration {reading.iteration}: pipeline stage {stage} measured "
                    f"{peak / MIB:.0f} MiB at its peak, over --max-memory-gib "
                    f"{self.budget / GIB:.3f} ({self.budget / MIB:.0f} MiB), although predicted "
                    f"{predicted / MIB:.0f} MiB; the memory model is refitted to cover it.",
                    flush=True,
                )
            self._cover(reading)

    def _fit(self) -> None:
        pp = self.model.dims.parallel.pp_size
        recent = self.observations[-FIT_WINDOW * pp :]
        scales, rests, errors = [], [], []
        for stage in range(pp):
            own = [o for o in recent if o[0] == stage]
            a, b, _ = fit_activation_scales([(t, s, peak - rest) for _, t, s, rest, peak in own])
            scales.append((a, b))
            rests.append(own[-1][3])
            for _, t, s, rest, peak in own:
                errors.append(abs(rest + a * t + b * s - peak) / peak)
        self.fitted = replace(self.model, resting_bytes=tuple(rests), stage_scales=tuple(scales))
        self.error = max(errors) if errors else None

    def _cover(self, reading: _Reading) -> None:
        """Scale a stage's activations up so the fitted model predicts at least what it measured."""
        model = self.current
        scales = list(model.stage_scales)
        for stage, (rest, peak) in enumerate(reading.gathered):
            terms = reading.predicted[stage]
            a, b = scales[stage]
            predicted = rest + a * terms.tokens + b * terms.scores
            activations = a * terms.tokens + b * terms.scores
            if predicted < peak and activations > 0:
                factor = (peak - rest) / activations
                scales[stage] = (a * factor, b * factor)
        self.fitted = replace(model, stage_scales=tuple(scales))

    def log_string(self, group: Any) -> str:
        """`` peak memory predicted/measured (MiB): P/M |`` of the step just run (a collective:
        every rank calls it where Megatron builds its iteration line)."""
        reading = self.close(group)
        if reading is None or reading.gathered is None:
            return ""
        predicted = max(t.total for t in reading.predicted)
        measured = max(peak for _, peak in reading.gathered)
        line = (
            f" peak memory predicted/measured (MiB): {predicted / MIB:.0f}/{measured / MIB:.0f} |"
        )
        if self.budget is not None:
            line += f" memory budget (MiB): {self.budget / MIB:.0f} |"
        return line

    def scalars(self) -> Dict[str, float]:
        reading = self.last
        if reading is None or reading.gathered is None:
            return {}
        values = {
            "dynbatch/peak memory predicted (MiB)": max(t.total for t in reading.predicted) / MIB,
            "dynbatch/peak memory measured (MiB)": max(p for _, p in reading.gathered) / MIB,
        }
        for stage, (_rest, peak) in enumerate(reading.gathered):
            values[f"dynbatch/peak memory measured stage {stage} (MiB)"] = peak / MIB
            values[f"dynbatch/peak memory predicted stage {stage} (MiB)"] = (
                reading.predicted[stage].total / MIB
            )
        return values


def _gather(
    rest: float, peak: float, stage: int, pp_size: int, group: Any
) -> List[Tuple[float, float]]:
    """Per pipeline stage, the largest ``(rest, peak)`` over the ranks of that stage."""
    if not (dist.is_available() and dist.is_initialized()):
        return [(rest, peak)] * pp_size
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )
    values = torch.zeros(3 * world, dtype=torch.float64, device=device)
    values[3 * rank : 3 * rank + 3] = torch.tensor([stage, rest, peak], dtype=torch.float64)
    dist.all_reduce(values, group=group)
    per_stage = [(0.0, 0.0)] * pp_size
    for r in range(world):
        s, r_rest, r_peak = values[3 * r : 3 * r + 3].tolist()
        old = per_stage[int(s)]
        per_stage[int(s)] = (max(old[0], r_rest), max(old[1], r_peak))
    return per_stage
