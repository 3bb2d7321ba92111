"""What one micro-batch costs to compute, as the runtime executes it: the one formula the planner,
the pipeline simulator, the plot and the benchmarks all use.

A micro-batch is a ``[B, S]`` tensor (``packed``: B rows of concatenated samples, usually one;
``padded``: one sample a row). Its forward costs

* **linear work** (embeddings, projections, MLP) on every one of its ``B * S`` positions, padding
  and placeholder rows included, since the GEMMs run over the whole tensor:
  ``token_weight * B * S``;
* **attention**, by what the attention implementation executes (``CostModel.attention``, one of
  ``spec.ATTENTION_KINDS``; ``None`` follows the layout: ``segment`` packed, ``causal`` padded):

  - ``causal``: each of the ``B`` rows is one causal sequence whatever it holds (packed or not):
    ``attention_weight * S**2`` a row (a causal kernel without segment boundaries);
  - ``dense``: each row computes the full ``S x S`` score matrix under a mask (Megatron's
    ``local`` attention): ``2 * attention_weight * S**2`` a row, twice a causal kernel;
  - ``segment`` (``packed`` only; padded rows count as ``causal``): THD segments (``cu_seqlens``). Each sample is one segment of its padded length
    ``round_up(L, sample_multiple)`` (the rounding pad sits inside the sample's segment, after its
    last token), and the row's padding tail ``T = S - used`` is cut into segments of
    :data:`TAIL_SEGMENT_TOKENS` (the materializer lays it out so), so the tail costs
    ``attention_weight * (q * t**2 + r**2)`` with ``T = q * t + r``: ``T**2`` for a short tail,
    about ``t * T`` for a long one (a placeholder row pays for its linear work, not for ``S**2``
    of attention over padding);

* **response work** (log-prob gather, value head, loss) on the response tokens of its real samples:
  ``response_weight * R``;
* a fixed **per-micro-batch overhead** (kernel launches, pipeline send/receive, bookkeeping),
  placeholders included: ``microbatch_overhead`` (the planner resolves an unknown overhead to a
  default share of a full row, :meth:`.spec.CostModel.resolved`; here ``None`` counts as 0).

Backward costs ``BACKWARD_TO_FORWARD_RATIO`` times the forward (see :mod:`.simulate`).

Worked example, ``packed``, ``S = 16``, samples of 3 and 6 tokens with ``sample_multiple = 4``
(segments 4 and 8, tail 4), ``token_weight = 1``, ``attention_weight = 0.1``, no response weight or
overhead: ``16 + 0.1 * (16 + 64 + 16) = 25.6``; a placeholder of the step costs
``16 + 0.1 * 256 = 41.6``.
"""

from __future__ import annotations

from typing import Callable, List, Mapping, Optional, Sequence, Tuple

from .spec import CostModel, check_cost_is_finite, round_up

__all__ = [
    "TAIL_SEGMENT_TOKENS",
    "check_cost_is_finite",
    "microbatch_cost",
    "rank_costs",
    "row_cost",
    "row_costs",
    "sample_costs",
    "step_microbatch_costs",
    "tail_cost",
    "tail_units",
]

#: The longest THD segment of a packed row's padding tail. A tail of one segment cost a whole
#: ``S**2`` of attention on a placeholder row (flash kernels attend over padding like over tokens);
#: cut into short segments it costs about ``TAIL_SEGMENT_TOKENS * T``. 128 is a flash-attention
#: tile: shorter segments save no more. The materializer rounds it up to the sample multiple.
TAIL_SEGMENT_TOKENS = 128
_TAIL_SQUARED = float(TAIL_SEGMENT_TOKENS * TAIL_SEGMENT_TOKENS)


def tail_units(tail: float) -> float:
    """Attention units (squared tokens) of a padding tail of ``tail`` tokens, cut into segments of
    :data:`TAIL_SEGMENT_TOKENS` (``tail**2`` up to one segment)."""
    if tail <= TAIL_SEGMENT_TOKENS:
        return tail * tail
    q = tail // TAIL_SEGMENT_TOKENS
    r = tail - q * TAIL_SEGMENT_TOKENS
    return q * _TAIL_SQUARED + r * r


def sample_costs(
    model: CostModel, layout: str, sizes: Sequence[int], response_lengths: Sequence[int]
) -> List[float]:
    """Every sample's share of a micro-batch's forward cost, besides the row itself (the planner's
    hot path: one list comprehension).

    ``sizes`` are the samples' padded segments (``round_up(L, sample_multiple)``). In the
    ``packed`` layout a sample brings its attention segment and its response work; in the
    ``padded`` layout only its response work (the row's attention is ``S**2`` whatever it holds,
    see :func:`row_cost`).
    """
    aw, rw = model.attention_weight, model.response_weight
    if model.attention_kind(layout) == "segment":
        if rw == 0.0:
            return [aw * (s * s) for s in sizes]
        return [aw * (s * s) + rw * r for s, r in zip(sizes, response_lengths, strict=True)]
    return [rw * r for r in response_lengths]


def row_cost(
    model: CostModel, layout: str, seq_length: int, micro_batch_size: int, load: int
) -> float:
    """Forward cost of a micro-batch's shape and padding, without its samples' :func:`sample_costs`.

    ``load`` is the padded tokens its samples fill (packed: the sum of their segments). Segment
    attention (packed): ``overhead + token_weight * S + attention_weight * tail_units(S - load)``
    (the tail's segments; 0 when the row is full). Causal / dense: ``overhead + B *
    (token_weight * S + f * attention_weight * S**2)`` with ``f`` 1 (causal) or 2 (dense),
    whatever the rows hold.
    """
    s = float(seq_length)
    kind = model.attention_kind(layout)
    if kind == "segment":
        # B > 1 packed rows are planned only where attention is not per segment (see
        # .step_search.multi_row_counts); for them the B tails count as one, an upper bound.
        tail = micro_batch_size * s - load
        return (
            model.overhead
            + model.token_weight * micro_batch_size * s
            + model.attention_weight * tail_units(tail)
        )
    factor = 2.0 if kind == "dense" else 1.0
    return model.overhead + micro_batch_size * (
        model.token_weight * s + factor * model.attention_weight * s * s
    )


def row_costs(
    model: CostModel,
    layout: str,
    seq_length: int,
    micro_batch_size: int,
    loads: Sequence[int],
    own: Sequence[float],
) -> List[float]:
    """``row_cost(..., load) + own`` of many micro-batches at once (the planner's hot path).

    ``own[b]`` is the sum of micro-batch ``b``'s :func:`sample_costs`; ``loads[b]`` its padded
    tokens (packed layout).
    """
    if model.attention_kind(layout) != "segment":
        row = row_cost(model, layout, seq_length, micro_batch_size, 0)
        return [row + o for o in own]
    s = float(seq_length)
    fixed = model.overhead + model.token_weight * s
    aw = model.attention_weight
    short = TAIL_SEGMENT_TOKENS
    return [
        fixed + aw * (t * t if (t := s - load) <= short else tail_units(t)) + o
        for o, load in zip(own, loads, strict=True)
    ]


def tail_cost(model: CostModel, seq_length: int) -> Callable[[int], float]:
    """The attention of a packed row's padding tail as a function of the row's padded load
    (0 unless the attention runs segments: a causal or dense row costs the same however full)."""
    s = float(seq_length)
    aw = model.attention_weight if model.attention_kind("packed") == "segment" else 0.0

    short = TAIL_SEGMENT_TOKENS

    def tail(load: int) -> float:
        # As row_costs: a tail within one segment squares in line (the balancer calls this per
        # candidate move).
        return aw * (t * t if (t := s - load) <= short else tail_units(t))

    return tail


def microbatch_cost(
    model: CostModel,
    layout: str,
    seq_length: int,
    micro_batch_size: int,
    sizes: Sequence[int],
    response_lengths: Sequence[int],
) -> float:
    """Forward cost of one micro-batch holding samples of padded ``sizes`` (``[]``: placeholder)."""
    return row_cost(model, layout, seq_length, micro_batch_size, sum(sizes)) + sum(
        sample_costs(model, layout, sizes, response_lengths)
    )


def rank_costs(
    model: CostModel,
    layout: str,
    seq_length: int,
    micro_batch_size: int,
    ranks: Sequence[Sequence[Sequence[int]]],
    lengths: Sequence[int],
    sizes: Sequence[int],
    responses: Sequence[int],
    row_lengths: Sequence[Sequence[int]] = (),
) -> Tuple[List[float], List[float]]:
    """Per DP rank of ``ranks[r][m]`` (sample indices into ``lengths``, padded ``sizes`` and
    ``responses``), in a step of uniform ``[micro_batch_size, seq_length]`` rows, or of
    ``row_lengths[r][m]`` where given (each micro-batch its own row): its samples' own cost
    (:meth:`CostModel.cost`) and what it computes (:func:`microbatch_cost` of every micro-batch,
    placeholders included). A plan's ``dp_imbalance_cost`` and ``dp_imbalance_computed`` are
    their max / mean, whichever planner built the ranks."""
    own = [sum(model.cost(lengths[i], responses[i]) for mb in rank for i in mb) for rank in ranks]
    computed = [
        sum(
            microbatch_cost(
                model,
                layout,
                row_lengths[r][m] if row_lengths else seq_length,
                micro_batch_size,
                [sizes[i] for i in mb],
                [responses[i] for i in mb],
            )
            for m, mb in enumerate(rank)
        )
        for r, rank in enumerate(ranks)
    ]
    return own, computed


def step_microbatch_costs(
    step,
    *,
    layout: str,
    lengths: Sequence[int],
    prompt_lengths: Sequence[int],
    sample_multiple: int,
    model: CostModel,
    kept_lengths: Optional[Mapping[int, int]] = None,
) -> List[List[float]]:
    """Forward cost of every micro-batch of a step, ``[rank][m]``, in schedule order.

    Args:
        step: A :class:`~.plan.StepPlan` (or anything with ``ranks``, ``seq_length`` and
            ``micro_batch_size``).
        layout: ``packed`` or ``padded``.
        lengths: Every sample's total length (indices refer to it).
        prompt_lengths: Every sample's prompt length (0 where unknown).
        sample_multiple: Each sample's segment is padded to a multiple of this.
        model: The cost model.
        kept_lengths: Samples cut by the ``truncate`` oversize policy -> their kept length
            (default: the step's own ``kept_lengths``).
    """
    if kept_lengths is None:
        kept_lengths = dict(getattr(step, "kept_lengths", ()) or ())
    s, b = step.seq_length, step.micro_batch_size
    result = []
    for rank in step.ranks:
        costs = []
        for mb in rank:
            kept = [kept_lengths.get(i, lengths[i]) for i in mb]
            sizes = [round_up(k, sample_multiple) for k in kept]
            responses = [max(0, k - prompt_lengths[i]) for k, i in zip(kept, mb, strict=True)]
            costs.append(microbatch_cost(model, layout, s, b, sizes, responses))
        result.append(costs)
    return result
