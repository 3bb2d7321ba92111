"""Quality measures of one step's schedule, the same for the planner and every baseline.

:func:`evaluate` takes ``ranks[r][m]`` (sample indices per micro-batch per DP rank; an empty list is a
placeholder) and reports how many micro-batches it runs against a lower bound, how much of the
computed tokens are real, the DP balance, cap violations and whether every sample is trained exactly
once. It also gives each micro-batch's cost for :func:`megatron_dynbatch.planning.simulate.simulate_step`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Dict, Optional, Sequence

__all__ = ["DEFAULT_ATTENTION_CROSSOVER", "LAYOUTS", "default_cost", "evaluate"]

#: Micro-batch layouts: ``packed`` = one row of concatenated samples; ``padded`` = ``B`` rows each
#: padded to the step's longest sample.
LAYOUTS = ("packed", "padded")

#: Sequence length at which self-attention's quadratic work equals the linear (MLP, projection) work
#: of a dense transformer: ``2*h*L^2 = 12*h^2*L`` at ``L = 6*h``, i.e. 24576 for ``h = 4096`` (a 7B
#: model; the same ratio verl's workload estimate uses).
DEFAULT_ATTENTION_CROSSOVER = 24576


def default_cost(length: int) -> float:
    """Relative compute of one sample: ``L + L^2 / DEFAULT_ATTENTION_CROSSOVER``."""
    return length + length * length / DEFAULT_ATTENTION_CROSSOVER


def _ratio_max_mean(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def evaluate(
    ranks: Sequence[Sequence[Sequence[int]]],
    lengths: Sequence[int],
    *,
    token_cap: int,
    layout: str = "packed",
    cost_fn: Optional[Callable[[int], float]] = None,
) -> Dict[str, Any]:
    """Measures one step's schedule.

    The step is assumed to run with one uniform micro-batch shape, as Megatron's pipeline
    communication needs: ``packed`` rows of length ``S`` = the largest micro-batch's tokens, or
    ``padded`` ``[B, S]`` with ``B`` = the most samples in any micro-batch and ``S`` = the longest
    sample. Placeholders run that same shape.

    Args:
        ranks: ``ranks[r][m]`` = global sample indices; ``[]`` = placeholder micro-batch.
        lengths: Token length of every sample of the step (indices refer to this list).
        token_cap: The per-micro-batch token budget the schedule was made for.
        layout: ``packed`` or ``padded``.
        cost_fn: Per-sample cost of a length; defaults to :func:`default_cost`.

    Returns:
        A dict with:

        * ``dp_size``, ``microbatches_per_rank``, ``num_microbatches`` (max over ranks),
          ``equal_counts``;
        * ``num_placeholders`` (empty micro-batches, all ranks), ``num_real_microbatches``;
        * ``lower_bound_microbatches``: oversize samples + ``ceil(other tokens / token_cap)``, all
          ranks together; ``lower_bound_per_rank`` = that over ``dp``, rounded up;
        * ``real_tokens``, ``seq_length`` (S), ``micro_batch_size`` (B), ``computed_tokens``
          (``dp * M * B * S``), ``fill`` (real / computed);
        * ``max_microbatch_tokens`` (largest footprint: tokens packed, rows x longest padded),
          ``over_cap_microbatches`` (footprint > cap with two or more samples), ``oversize_samples``;
        * ``rank_tokens``, ``dp_imbalance`` (max / mean real tokens over ranks), ``rank_costs``,
          ``dp_imbalance_cost`` (the same by ``cost_fn``);
        * ``microbatch_costs[r][m]``: compute cost of the micro-batch in the uniform shape (packed:
          its samples plus one padding segment up to S; padded: B rows of S), for the simulator;
          ``microbatch_real_costs[r][m]``: its samples only;
        * ``coverage_ok``, ``missing``, ``duplicated``, ``out_of_range``: every sample exactly once.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}.")
    if isinstance(token_cap, bool) or not isinstance(token_cap, int) or token_cap < 1:
        raise ValueError(f"token_cap={token_cap!r} must be an integer >= 1.")
    if not ranks:
        raise ValueError("ranks is empty; pass one list of micro-batches per DP rank.")
    cost = cost_fn if cost_fn is not None else default_cost
    n = len(lengths)
    dp_size = len(ranks)

    seen = Counter(i for rank in ranks for mb in rank for i in mb)
    out_of_range = sorted(i for i in seen if not (isinstance(i, int) and 0 <= i < n))
    duplicated = sorted(i for i, count in seen.items() if count > 1 and i not in out_of_range)
    missing = [i for i in range(n) if i not in seen]
    valid = [[[i for i in mb if i not in out_of_range] for mb in rank] for rank in ranks]

    counts = [len(rank) for rank in valid]
    num_microbatches = max(counts)
    all_mbs = [mb for rank in valid for mb in rank]
    num_placeholders = sum(1 for mb in all_mbs if not mb)

    oversize = sorted(i for i in range(n) if lengths[i] > token_cap)
    other_tokens = sum(length for length in lengths if length <= token_cap)
    lower_bound = len(oversize) + -(-other_tokens // token_cap)

    def footprint(mb: Sequence[int]) -> int:
        if not mb:
            return 0
        if layout == "packed":
            return sum(lengths[i] for i in mb)
        return len(mb) * max(lengths[i] for i in mb)

    real_tokens = sum(lengths[i] for mb in all_mbs for i in mb)
    if layout == "packed":
        micro_batch_size = 1
        seq_length = max((footprint(mb) for mb in all_mbs), default=0)
    else:
        micro_batch_size = max((len(mb) for mb in all_mbs), default=1) or 1
        seq_length = max((lengths[i] for mb in all_mbs for i in mb), default=0)
    computed = dp_size * num_microbatches * micro_batch_size * seq_length
    over_cap = sum(1 for mb in all_mbs if len(mb) > 1 and footprint(mb) > token_cap)

    def computed_cost(mb: Sequence[int]) -> float:
        if layout == "padded":
            return micro_batch_size * cost(seq_length) if seq_length else 0.0
        used = sum(lengths[i] for i in mb)
        padding = seq_length - used
        return sum(cost(lengths[i]) for i in mb) + (cost(padding) if padding > 0 else 0.0)

    rank_tokens = [sum(lengths[i] for mb in rank for i in mb) for rank in valid]
    real_costs = [[sum(cost(lengths[i]) for i in mb) for mb in rank] for rank in valid]
    rank_costs = [sum(rank) for rank in real_costs]
    return {
        "dp_size": dp_size,
        "microbatches_per_rank": counts,
        "num_microbatches": num_microbatches,
        "equal_counts": len(set(counts)) == 1,
        "num_placeholders": num_placeholders,
        "num_real_microbatches": len(all_mbs) - num_placeholders,
        "lower_bound_microbatches": lower_bound,
        "lower_bound_per_rank": -(-lower_bound // dp_size),
        "real_tokens": real_tokens,
        "seq_length": seq_length,
        "micro_batch_size": micro_batch_size,
        "computed_tokens": computed,
        "fill": real_tokens / computed if computed else 0.0,
        "max_microbatch_tokens": max((footprint(mb) for mb in all_mbs), default=0),
        "over_cap_microbatches": over_cap,
        "oversize_samples": oversize,
        "rank_tokens": rank_tokens,
        "dp_imbalance": _ratio_max_mean(rank_tokens),
        "rank_costs": rank_costs,
        "dp_imbalance_cost": _ratio_max_mean(rank_costs),
        "microbatch_costs": [[computed_cost(mb) for mb in rank] for rank in valid],
        "microbatch_real_costs": real_costs,
        "coverage_ok": not (missing or duplicated or out_of_range),
        "missing": missing,
        "duplicated": duplicated,
        "out_of_range": out_of_range,
    }
