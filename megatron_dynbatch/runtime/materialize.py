"""Turn one DP rank's share of a :class:`StepPlan` into full-shape micro-batch tensors.

Layouts (``B`` = ``step_plan.micro_batch_size``, ``S`` = ``step_plan.seq_length``):

* ``packed``: the micro-batch's samples are concatenated in one row, each padded to a multiple of
  ``sample_multiple`` (TP/CP split every THD segment evenly), and the row is padded to ``S`` with a
  trailing padding segment; with ``B > 1`` the plan's ``packed_rows`` says which samples fill each
  of the B rows, each laid out the same way (``cu_seqlens`` runs over the row-major flattening,
  so no segment crosses a row boundary).
* ``padded``: one sample per row, padded the same way and then to ``S``; rows beyond the
  micro-batch's samples are placeholder rows.

A placeholder micro-batch (an empty tuple in the plan) is a full ``[B, S]`` micro-batch of padding
(:func:`~megatron_dynbatch.runtime.placeholders.placeholder_microbatch`, which every micro-batch
starts from):
every key has the same dtype and shape as in a real micro-batch of the step, the loss mask is zero
everywhere. It is never a 1- or 2-token stub, so it flows through every pipeline stage, every
attention kernel and every reduction exactly like real data and contributes nothing to the loss.

Worked example, packed, ``S = 16``, ``sample_multiple = 4``, samples 7 (``L = 3``) and 2
(``L = 6``)::

    column         0  1  2  3 | 4  5  6  7  8  9 10 11 | 12 13 14 15
    segment_ids    0  0  0  0 | 1  1  1  1  1  1  1  1 |  2  2  2  2
    position_ids   0  1  2  3 | 0  1  2  3  4  5  6  7 |  0  1  2  3
    sample_index   7  7  7 -1 | 2  2  2  2  2  2 -1 -1 | -1 -1 -1 -1
    cu_seqlens     [0, 4, 12, 16]

Sample 7 keeps its 3 real tokens plus one rounding pad inside its own segment; the last real token
of each sample (columns 2 and 9) has label 0 and loss mask 0, so no label ever comes from the next
sample.
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import StepPlan
from megatron_dynbatch.planning.cost import TAIL_SEGMENT_TOKENS
from megatron_dynbatch.planning.schedule import ScheduledStep
from megatron_dynbatch.planning.spec import LAYOUTS, as_int, round_up
from megatron_dynbatch.runtime.placeholders import placeholder_microbatch
from megatron_dynbatch.runtime.schema import BatchSchema, CheckedSample

__all__ = ["BUILTIN_KEYS", "materialize_microbatches", "microbatch_shapes"]

#: Keys every micro-batch has besides the schema's fields, with their dtypes.
BUILTIN_KEYS: Dict[str, torch.dtype] = {
    "tokens": torch.int64,
    "labels": torch.int64,
    "loss_mask": torch.float32,
    "position_ids": torch.int64,
    "segment_ids": torch.int64,
    "sample_index": torch.int64,
    "cu_seqlens": torch.int32,
}


def microbatch_shapes(
    schema: BatchSchema, *, micro_batch_size: int, seq_length: int
) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every ``[B, S, ...]`` key of a step's micro-batches.

    ``cu_seqlens`` is left out: its length is the number of THD segments plus one, which depends on
    the micro-batch's samples. It is consumed by the attention kernel of the local stage and never
    crosses a pipeline boundary, so its variable length does not affect the schedule.
    """
    b, s = micro_batch_size, seq_length
    shapes = {key: ((b, s), dtype) for key, dtype in BUILTIN_KEYS.items() if key != "cu_seqlens"}
    for spec in schema.fields:
        shapes[spec.name] = ((b, s, *spec.trailing_shape), spec.dtype)
    return shapes


def _check_arguments(step_plan: StepPlan, dp_rank: int, layout: str, sample_multiple: int) -> None:
    if layout not in LAYOUTS:
        raise DynBatchValueError(
            f"layout={layout!r} is not one of {LAYOUTS}; pass the Plan's layout."
        )
    if (
        isinstance(sample_multiple, bool)
        or not isinstance(sample_multiple, int)
        or sample_multiple < 1
    ):
        raise DynBatchValueError(
            f"sample_multiple={sample_multiple!r} must be an integer >= 1; pass the Plan's "
            "sample_multiple."
        )
    b, s = step_plan.micro_batch_size, step_plan.seq_length
    if b < 1 or s < 1:
        raise DynBatchValueError(
            f"step plan has micro_batch_size={b}, seq_length={s}; both must be >= 1 (an empty "
            "micro-batch shape cannot run through the pipeline)."
        )
    packed_rows = _plan_packed_rows(step_plan)
    if layout == "packed" and b != 1 and not packed_rows:
        raise DynBatchValueError(
            "layout='packed' with micro_batch_size="
            f"{b} needs the step plan's packed_rows (how many samples each row holds); the step "
            "plan has none: re-plan, or use layout='padded'."
        )
    if packed_rows:
        if layout != "packed":
            raise DynBatchValueError(
                f"the step plan has packed_rows but layout={layout!r}; pass the Plan's layout."
            )
        rank = step_plan.rank_microbatches(dp_rank)
        counts = packed_rows[dp_rank] if dp_rank < len(packed_rows) else ()
        if len(counts) != len(rank) or any(
            len(row) != b or sum(row) != len(mb) for row, mb in zip(counts, rank, strict=True)
        ):
            raise DynBatchValueError(
                f"dp_rank={dp_rank}: packed_rows {list(counts)[:4]} do not split the rank's "
                f"{len(rank)} micro-batches into micro_batch_size={b} rows each; the plan is "
                "corrupt."
            )
    if s % sample_multiple != 0:
        raise DynBatchValueError(
            f"seq_length={s} is not a multiple of sample_multiple={sample_multiple}: the row's "
            "padding segment would not split evenly over TP/CP ranks. Pass the sample_multiple "
            "the step was planned with (Plan.sample_multiple; a ShardedPlan's: its config's "
            "parallel.sample_multiple), or plan with the layout (tp_size, cp_size) that needs "
            f"{sample_multiple}."
        )
    if len(step_plan.rank_microbatches(dp_rank)) != step_plan.num_microbatches:
        raise DynBatchValueError(
            f"dp_rank={dp_rank} has {len(step_plan.rank_microbatches(dp_rank))} micro-batches but "
            f"the step plan says num_microbatches={step_plan.num_microbatches}; the plan is "
            "corrupt."
        )
    rows = _plan_row_lengths(step_plan, dp_rank)
    if rows:
        if layout != "packed" or b != 1:
            raise DynBatchValueError(
                f"the step plan has variable row lengths with layout={layout!r} and "
                f"micro_batch_size={b}; variable rows are planned for one packed row a "
                "micro-batch: pass the Plan's layout."
            )
        bad = [row for row in rows if row < 1 or row > s or row % sample_multiple]
        if len(rows) != step_plan.num_microbatches or bad:
            raise DynBatchValueError(
                f"dp_rank={dp_rank}: row_lengths {list(rows)[:8]} do not give each of the "
                f"{step_plan.num_microbatches} micro-batches a row of 1..seq_length={s} tokens, "
                f"a multiple of sample_multiple={sample_multiple}; the plan is corrupt."
            )


def _check_planned_lengths(step: Any, dp_rank: int, checked: Mapping[int, CheckedSample]) -> None:
    """Refuse a sample whose tokens differ from the length it was planned with.

    A sharded plan leaves its rows to the samples, so a longer sample would widen its row past the
    cap the plan kept, unseen; in a global plan a longer one overflows its row, and a shorter one
    is most likely another sample than the one planned (a trainer's indices or lengths out of
    step with its data), which would train without an error in a row planned for another.
    """
    if getattr(step, "planned_lengths", ()):
        planned = dict(enumerate(step.planned_lengths[dp_rank]))
    else:
        planned = dict(getattr(step, "sample_lengths", ()) or ())
    for i, cs in checked.items():
        if i in planned and cs.length != planned[i]:
            raise DynBatchValueError(
                f"dp_rank={dp_rank}: sample {i} has {cs.length} tokens but was planned with "
                f"{planned[i]}; plan with the lengths of the samples materialized (after any "
                "cut or padding the trainer applies)."
            )


def _sized(
    step: Any,
    dp_rank: int,
    checked: Mapping[int, CheckedSample],
    layout: str,
    sample_multiple: int,
) -> Any:
    """A step whose plan left ``seq_length`` to the samples (a sharded plan), with the row this
    rank's micro-batches need: packed, one row as long as its fullest micro-batch's padded
    samples; padded, as many rows as its fullest micro-batch holds, each as long as its longest
    padded sample (at least one ``sample_multiple`` either way)."""
    if (
        layout not in LAYOUTS
        or isinstance(sample_multiple, bool)
        or not isinstance(sample_multiple, int)
        or sample_multiple < 1
    ):
        _check_arguments(dataclasses.replace(step, seq_length=1), dp_rank, layout, sample_multiple)
    sizes = {i: round_up(cs.length, sample_multiple) for i, cs in checked.items()}
    mbs = step.rank_microbatches(dp_rank)
    if layout == "packed":
        # One packed row a micro-batch (the plan's micro_batch_size counts a padded host's rows).
        longest = max([sum(sizes[i] for i in mb) for mb in mbs] + [sample_multiple])
        return dataclasses.replace(step, seq_length=longest, micro_batch_size=1)
    longest = max(list(sizes.values()) + [sample_multiple])
    # This rank's own fullest micro-batch, not the step's (another rank's): its rank was planned
    # to [B, S] within the cap by its own samples, and S here is its own longest.
    rows = max([len(mb) for mb in mbs] + [1])
    return dataclasses.replace(step, seq_length=longest, micro_batch_size=rows)


def _plan_row_lengths(step_plan: Any, dp_rank: int) -> Tuple[int, ...]:
    """This rank's variable row lengths (``()``: every row is ``seq_length``)."""
    rows = getattr(step_plan, "row_lengths", ())
    if not rows:
        return ()
    if dp_rank >= len(rows):
        raise DynBatchValueError(
            f"dp_rank={dp_rank} but the step plan has row lengths for {len(rows)} DP ranks; the "
            "plan is corrupt."
        )
    return tuple(rows[dp_rank])


def _plan_packed_rows(step_plan: Any) -> Tuple[Tuple[Tuple[int, ...], ...], ...]:
    """The step's ``packed_rows`` (``()`` for a step plan without them)."""
    return tuple(getattr(step_plan, "packed_rows", ()) or ())


def _packed_rows(mb: Sequence[int], counts: Sequence[int]) -> List[List[int]]:
    """Split a packed micro-batch's samples into its rows: ``counts[k]`` samples in row ``k``."""
    rows, start = [], 0
    for count in counts:
        rows.append(list(mb[start : start + count]))
        start += count
    return rows


def _check_rank_samples(
    step_plan: StepPlan, dp_rank: int, samples: Mapping[int, Mapping[str, Any]], schema: BatchSchema
) -> Dict[int, CheckedSample]:
    """Validate every sample the rank's micro-batches name, once, before building anything."""
    if not isinstance(samples, Mapping):
        # A list "held" no index (``in`` compares values), and the refusal then told a caller
        # who passed every sample to pass every sample (a probe).
        raise DynBatchValueError(
            f"samples must map each global sample index to its sample (a dict), got "
            f"{type(samples).__name__}; for a list of the step's samples in plan order pass "
            "dict(enumerate(samples))."
        )
    seen: Dict[int, int] = {}
    checked: Dict[int, CheckedSample] = {}
    for m, mb in enumerate(step_plan.rank_microbatches(dp_rank)):
        for index in mb:
            if index in seen:
                # Training a sample twice would silently double its loss weight.
                raise DynBatchValueError(
                    f"dp_rank={dp_rank}: sample {index} appears in micro-batch {seen[index]} and "
                    f"again in micro-batch {m}; the plan is corrupt."
                )
            seen[index] = m
            if index not in samples:
                keyed = (
                    f"; the samples are keyed by {type(next(iter(samples))).__name__} (e.g. "
                    f"{next(iter(samples))!r}): key them by the plan's int sample index"
                    if samples and not any(isinstance(key, int) for key in samples)
                    else ""
                )
                raise DynBatchValueError(
                    f"dp_rank={dp_rank}, micro-batch {m}: the plan names sample {index}, which "
                    f"this rank was not given ({len(samples)} samples given){keyed}; pass every "
                    f"sample of step_plan.rank_microbatches({dp_rank})."
                )
            checked[index] = schema.check_sample(index, samples[index])
    return checked


def _truncate(
    checked: Dict[int, CheckedSample], step_plan: Any, schema: BatchSchema
) -> Dict[int, CheckedSample]:
    """Cut the samples the plan truncated (``oversize_samples="truncate"``) to their kept length.

    The plan's ``kept_lengths`` says how many leading tokens of each cut sample it planned for; the
    rest is dropped from the row (never trained), token fields with it. The last kept token has
    no successor in the row, so it keeps label 0 and loss mask 0, like any sample's last token.
    """
    kept = dict(getattr(step_plan, "kept_lengths", ()) or ())
    for index, keep in kept.items():
        cs = checked.get(index)
        if cs is None or cs.length <= keep:
            continue
        fields = {
            spec.name: cs.fields[spec.name][:keep] if spec.kind == "token" else cs.fields[spec.name]
            for spec in schema.fields
        }
        checked[index] = CheckedSample(
            index=index, tokens=cs.tokens[:keep], loss_mask=cs.loss_mask[:keep], fields=fields
        )
    return checked


def _fill_row(
    batch: Dict[str, torch.Tensor],
    row: int,
    row_samples: Sequence[CheckedSample],
    schema: BatchSchema,
    sample_multiple: int,
    boundaries: List[int],
    where: str,
    split_tail: bool,
) -> None:
    """Lay ``row_samples`` out in ``batch[...][row]`` and append the row's THD segment ends.

    ``boundaries`` holds cu_seqlens over the row-major flattening of ``[B, S]``, so row ``r``'s
    segments start at ``r * S``. ``split_tail``: cut the padding tail into segments of
    :data:`~megatron_dynbatch.planning.cost.TAIL_SEGMENT_TOKENS` (THD rows); otherwise it is one
    segment (padded rows and rows of ``B > 1``, whose attention runs over the whole row).
    """
    s = batch["tokens"].shape[1]
    padded_lengths = [round_up(cs.length, sample_multiple) for cs in row_samples]
    if sum(padded_lengths) > s:
        detail = ", ".join(
            f"sample {cs.index}: L={cs.length} -> {p}"
            for cs, p in zip(row_samples, padded_lengths, strict=True)
        )
        raise DynBatchValueError(
            f"{where}: the samples need {sum(padded_lengths)} tokens after padding each to a "
            f"multiple of sample_multiple={sample_multiple} ({detail}), more than seq_length={s}; "
            "re-plan with the same sample_multiple or pass the plan's layout and sample_multiple."
        )
    base = row * s
    ends = list(accumulate(padded_lengths))
    used = ends[-1] if ends else 0
    k = len(row_samples)
    if k:
        _write_samples(batch, row, row_samples, schema, padded_lengths, ends)
    boundaries.extend(base + end for end in ends)
    if used < s:
        # The padding tail is its own segments (ids k, k + 1, ...) so attention never mixes it
        # into a sample. A THD row cuts it into segments of TAIL_SEGMENT_TOKENS (rounded up to the
        # sample multiple, which TP and CP split evenly): flash kernels attend over padding as over
        # tokens, so one segment made a placeholder row cost S**2 of attention (the cost model,
        # planning.cost.tail_units, prices the same cut).
        chunk = round_up(TAIL_SEGMENT_TOKENS, sample_multiple) if split_tail else s - used
        starts = range(used, s, chunk)
        offsets = torch.arange(s - used)
        batch["position_ids"][row, used:s] = offsets % chunk
        batch["segment_ids"][row, used:s] = k + offsets // chunk
        boundaries.extend(base + min(start + chunk, s) for start in starts)


def _write_samples(
    batch: Dict[str, torch.Tensor],
    row: int,
    row_samples: Sequence[CheckedSample],
    schema: BatchSchema,
    padded_lengths: Sequence[int],
    ends: Sequence[int],
) -> None:
    """Write the samples of one row, each at the start of its padded segment (``ends``: the
    segments' ends, the running sum of ``padded_lengths``).

    A few whole-row tensor operations, not several per sample: a packed row holds tens of
    documents, and on a GPU this runs before every step while the device waits (the host work
    before a step, this included, was 20-55 ms of a 700-1,100 ms iteration on the H200 check,
    docs/gpu.md).
    """
    k = len(row_samples)
    lengths = [cs.length for cs in row_samples]
    used = ends[-1]
    segments = torch.arange(k)
    padded = torch.tensor(padded_lengths)
    starts = torch.tensor([0, *ends[:-1]])
    # Positions count within the THD segment, rounding pad included, so position_ids[t] is
    # always t - cu_seqlens[segment of t].
    segment_of = torch.repeat_interleave(segments, padded)
    batch["segment_ids"][row, :used] = segment_of
    batch["position_ids"][row, :used] = torch.arange(used) - starts[segment_of]
    real = sum(lengths)
    sample_of = torch.repeat_interleave(segments, torch.tensor(lengths))
    # The row's columns of the samples' tokens, in sample order: contiguous unless rounding
    # pads sit between samples.
    sample_ends = list(accumulate(lengths))
    if list(padded_lengths) == lengths:
        columns: Any = slice(0, real)
    else:
        first = torch.tensor([0, *sample_ends[:-1]])
        columns = starts[sample_of] + torch.arange(real) - first[sample_of]
    # Label j is token j + 1 of the same sample; a sample's last token has no successor here
    # (the next column belongs to padding or to another sample), so it keeps label 0, mask 0.
    last = [end - 1 for end, n in zip(sample_ends, lengths, strict=True) if n]
    is_last = torch.bincount(torch.tensor(last, dtype=torch.int64), minlength=real)
    source = torch.arange(real)[is_last == 0]
    target = source if isinstance(columns, slice) else columns[source]

    def put(name: str, values: torch.Tensor, shifted: bool) -> None:
        out = batch[name][row]
        values = values.to(out.dtype)
        if shifted:
            out[target] = values[source + 1]
        else:
            out[columns] = values

    tokens = torch.cat([cs.tokens for cs in row_samples])
    put("tokens", tokens, False)
    put("labels", tokens, True)
    put("loss_mask", torch.cat([cs.loss_mask for cs in row_samples]), True)
    batch["sample_index"][row, columns] = torch.tensor([cs.index for cs in row_samples])[sample_of]
    for spec in schema.fields:
        values = [cs.fields[spec.name] for cs in row_samples]
        if spec.kind == "token":
            put(spec.name, torch.cat(values), spec.shift_to_labels)
        else:
            # A sample field [*trailing] broadcasts over the sample's L tokens.
            put(spec.name, torch.stack(values)[sample_of], False)


def materialize_microbatches(
    step_plan: Union[StepPlan, ScheduledStep],
    dp_rank: int,
    samples: Mapping[int, Mapping[str, Any]],
    schema: BatchSchema,
    *,
    layout: str,
    sample_multiple: int,
    device: Optional[Union[str, torch.device]] = None,
) -> List[Dict[str, torch.Tensor]]:
    """Build the micro-batch dicts of one DP rank for one step, in plan order.

    Args:
        step_plan: The step's :class:`~megatron_dynbatch.planning.plan.StepPlan`, or a step of
            any plan kind's :meth:`~megatron_dynbatch.planning.schedule.Schedule.scheduled_steps`
            (a sharded plan's, ``seq_length=None``, gets rows that fit this rank's samples).
        dp_rank: This rank's data-parallel index.
        samples: Global sample index -> sample mapping (see ``schema.py``). It must hold every
            sample ``step_plan.rank_microbatches(dp_rank)`` names; other ranks' samples may be
            absent.
        schema: Declared fields; it fixes the dtypes and trailing shapes, placeholders included.
        layout: ``packed`` or ``padded`` (the ``Plan``'s ``layout``).
        sample_multiple: Every sample's THD segment is padded to a multiple of this (the ``Plan``'s
            ``sample_multiple``).
        device: Where the tensors are built; ``None`` means CPU (the trainer moves them, as
            Megatron's ``get_batch`` does).

    Returns:
        ``step_plan.num_microbatches`` dicts. Every ``[B, S, ...]`` key has the same shape and dtype
        in all of them (see :func:`microbatch_shapes`), except that with the plan's variable
        ``row_lengths`` micro-batch ``m`` has ``S = row_lengths[dp_rank][m]`` (for hosts that
        exchange shapes, e.g. Megatron with ``variable_seq_lengths``); ``cu_seqlens`` is int32
        ``[num_segments + 1]``.

    Samples the plan cut to the cap (its ``kept_lengths``, ``oversize_samples="truncate"``) are
    cut here to the same length: their remaining tokens are not trained.

    Raises:
        ValueError: On a bad layout or sample_multiple, a sample the rank was not given, a sample
            failing the schema, or samples whose padded lengths do not fit ``seq_length``.
    """
    if not hasattr(step_plan, "rank_microbatches") or not hasattr(step_plan, "seq_length"):
        steps = "plan.steps[s]" if hasattr(step_plan, "steps") else "a step of the plan"
        raise DynBatchValueError(
            f"step_plan is a {type(step_plan).__name__}; pass one step, {steps} (or "
            "plan.scheduled_steps()[s])."
        )
    rank = as_int(dp_rank)
    if rank is None:  # its range is the plan's check
        raise DynBatchValueError(
            f"dp_rank={dp_rank!r} must be an integer in [0, {len(step_plan.ranks)}): this "
            "process's data-parallel rank."
        )
    dp_rank = rank
    if not isinstance(schema, BatchSchema):
        raise DynBatchValueError(
            f"schema={schema!r} must be a BatchSchema (BatchSchema() for tokens alone)."
        )
    multiple = as_int(sample_multiple)  # numpy / torch integers too
    if multiple is not None:
        sample_multiple = multiple
    if getattr(step_plan, "rows_per_cp_rank", False):
        raise DynBatchValueError(
            "the step's row lengths count one context-parallel rank's share (slime's schedule); "
            "pass step.whole_rows(cp_size), whose rows the materializer builds before the CP split."
        )
    if step_plan.seq_length is None:
        # A sharded plan leaves the row to the samples: this rank's rows fit its own samples.
        checked = _check_rank_samples(step_plan, dp_rank, samples, schema)
        _check_planned_lengths(step_plan, dp_rank, checked)
        step_plan = _sized(step_plan, dp_rank, checked, layout, sample_multiple)
        _check_arguments(step_plan, dp_rank, layout, sample_multiple)
    else:
        _check_arguments(step_plan, dp_rank, layout, sample_multiple)
        checked = _check_rank_samples(step_plan, dp_rank, samples, schema)
        _check_planned_lengths(step_plan, dp_rank, checked)
    checked = _truncate(checked, step_plan, schema)
    b, longest = step_plan.micro_batch_size, step_plan.seq_length
    packed_rows = _plan_packed_rows(step_plan)
    # Variable rows (a host that exchanges shapes per micro-batch): each micro-batch its own S.
    row_lengths = _plan_row_lengths(step_plan, dp_rank)
    target = torch.device("cpu") if device is None else torch.device(device)

    microbatches: List[Dict[str, torch.Tensor]] = []
    for m, mb in enumerate(step_plan.rank_microbatches(dp_rank)):
        s = row_lengths[m] if row_lengths else longest
        where = f"dp_rank={dp_rank}, micro-batch {m} (samples {tuple(mb)})"
        if layout == "padded" and len(mb) > b:
            raise DynBatchValueError(
                f"{where}: {len(mb)} samples do not fit micro_batch_size={b} rows of the padded "
                "layout; the plan was made for another layout or micro-batch size."
            )
        batch = placeholder_microbatch(schema, b, s, target)
        boundaries = [0]
        if layout == "packed":
            rows = _packed_rows(mb, packed_rows[dp_rank][m] if packed_rows else (len(mb),))
        else:
            rows = [[i] for i in mb]
        rows += [[] for _ in range(b - len(rows))]  # placeholder rows of the micro-batch
        for row, indices in enumerate(rows):
            _fill_row(
                batch,
                row,
                [checked[i] for i in indices],
                schema,
                sample_multiple,
                boundaries,
                f"{where}, row {row}",
                split_tail=layout == "packed" and b == 1,
            )
        batch["cu_seqlens"] = torch.tensor(boundaries, dtype=torch.int32, device=target)
        microbatches.append(batch)

    for m, batch in enumerate(microbatches):
        s = row_lengths[m] if row_lengths else longest
        expected = microbatch_shapes(schema, micro_batch_size=b, seq_length=s)
        # Placeholders and real micro-batches come from the same constructor; this guards that a
        # future change cannot give a lagging rank tensors of another shape than its peers.
        assert set(batch) == set(expected) | {"cu_seqlens"}, sorted(batch)
        for key, (shape, dtype) in expected.items():
            assert tuple(batch[key].shape) == shape and batch[key].dtype == dtype, (key, shape)
        assert int(batch["cu_seqlens"][-1]) == b * s, batch["cu_seqlens"]
    return microbatches
