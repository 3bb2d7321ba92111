"""The planner registry: every planner by name, one signature, one result type.

A planner takes the validated samples and the planner config and returns a :class:`.plan.Plan`,
the one schedule type the runtime materializes, :func:`.invariants.check_plan` re-derives and
``megatron-dynbatch plan`` prints::

    Planner = Callable[[SampleSet, PlannerConfig], Plan]

The hosts plan through :func:`run_planner`, which runs the planner the config names
(:attr:`.spec.PlannerConfig.planner`, ``dynbatch`` unless told otherwise); ``megatron-dynbatch
plan --dynamic-batch-planner NAME`` and the benchmarks look a planner up by the same name
(:func:`get_planner`).

Built in: ``dynbatch`` (this package's planner, :func:`.planner.plan_samples`),
``dynbatch-thorough`` (the same, spending more planning CPU under a pipeline:
:data:`.spec.THOROUGH_PLANNER`) and ``fixed``
(Megatron's stock batching: a fixed ``micro_batch_size`` of padded rows, :mod:`.fixed`). Another
scheduler registers with :func:`register_planner`; one that produces ``ranks[r][m]`` (sample
indices per micro-batch per DP rank) for a step becomes a planner through :func:`ranks_planner`,
which describes its ranks as a Plan (:func:`plan_from_ranks`). The upstream schedulers of
``benchmarks/baselines.py`` register so when that module is imported; a name ``module:name``
imports ``module`` first, e.g. ``--dynamic-batch-planner benchmarks.baselines:verl_kk`` from a checkout.
"""

from __future__ import annotations

import importlib
import inspect
import numbers
import os
import sys
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

from megatron_dynbatch.errors import DynBatchTypeError, DynBatchValueError

from .cost import rank_costs
from .fixed import plan_fixed_samples
from .plan import Plan, PlanStats, StepPlan, imbalance

# The planner's own oversize policy, so an adapted scheduler refuses or cuts exactly as ours does.
from .planner import _apply_oversize_policy, plan_samples
from .samples import SampleSet
from .spec import DEFAULT_PLANNER, THOROUGH_PLANNER, PlannerConfig, ceil_div, round_up
from .step_search import variable_rows

__all__ = [
    "DEFAULT_PLANNER",
    "Planner",
    "get_planner",
    "plan_from_ranks",
    "ranks_planner",
    "register_planner",
    "required_layout",
    "run_planner",
    "planner_names",
    "plan_schedule",
]

#: Samples and config in, the whole schedule out.
Planner = Callable[[SampleSet, PlannerConfig], Plan]
#: ``ranks[r][m]``: sample indices of micro-batch ``m`` on DP rank ``r``; empty = placeholder.
StepRanks = Sequence[Sequence[Sequence[int]]]
#: One step's scheduler: its samples' lengths and rollout keys (local indices), the config ->
#: ``ranks[r][m]`` of local indices.
RanksScheduler = Callable[[List[int], List[Hashable], PlannerConfig], StepRanks]

_PLANNERS: Dict[str, Planner] = {}

#: Planners that plan one layout only (Megatron's stock batching pads ``[B, S]`` rows), so a
#: config can be refused at start-up rather than at its first step.
_REQUIRED_LAYOUTS: Dict[str, str] = {"fixed": "padded"}


def required_layout(name: str) -> Optional[str]:
    """The one layout planner ``name`` plans, or ``None`` where it plans either."""
    return _REQUIRED_LAYOUTS.get(name)


def register_planner(name: str, planner: Planner, *, replace: bool = False) -> Planner:
    """Make ``planner`` available as ``name`` and return it. A second registration of a taken
    name is refused unless ``replace`` (registering the same function again is harmless)."""
    if not isinstance(name, str) or not name or ":" in name:
        raise DynBatchValueError(f"planner name {name!r} must be a non-empty str without ':'.")
    if not callable(planner):
        raise DynBatchTypeError(f"planner {name!r} must be callable, got {type(planner)!r}.")
    if name in _PLANNERS and not replace and _PLANNERS[name] is not planner:
        raise DynBatchValueError(
            f"planner {name!r} is already registered; pick another name or pass replace=True."
        )
    _PLANNERS[name] = planner
    return planner


def planner_names() -> Tuple[str, ...]:
    """The registered names, sorted."""
    return tuple(sorted(_PLANNERS))


def _import_planner_module(module: str) -> None:
    """Import ``module`` as ``python -m`` would from here: the ``megatron-dynbatch`` console
    script, unlike ``python -m megatron_dynbatch``, does not put the working directory on the
    import path, so ``benchmarks.baselines:verl_kk`` named from a checkout is looked up there too
    when nothing on the path has it."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".", 1)[0]
        here = os.getcwd()
        local = os.path.isdir(os.path.join(here, top)) or os.path.isfile(
            os.path.join(here, top + ".py")
        )
        if exc.name != top or not local or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)  # last: never shadows an installed module
        importlib.import_module(module)


def get_planner(name: str) -> Planner:
    """The planner registered as ``name``; ``module:name`` imports ``module`` first."""
    if isinstance(name, str) and ":" in name:
        module, _, name = name.partition(":")
        if not module or not name:
            raise DynBatchValueError(
                f"planner {module + ':' + name!r} must be 'module:name' with both parts (a module "
                f"that registers the planner, and its name), or one of {list(planner_names())}."
            )
        try:
            _import_planner_module(module)
        except ImportError as exc:
            raise DynBatchValueError(
                f"planner module {module!r} cannot be imported ({exc}); run from where it is "
                f"importable or pick one of {list(planner_names())}."
            ) from None
    planner = _PLANNERS.get(name)
    if planner is None:
        raise DynBatchValueError(
            f"no planner named {name!r}; registered: {list(planner_names())} "
            "(a module that registers more is named as 'module:name')."
        )
    return planner


def run_planner(samples: SampleSet, config: PlannerConfig) -> Plan:
    """Plan ``samples`` with the planner ``config.planner`` names (what every host calls).

    A planner registered from outside this package is held to the same guarantees as ours: its
    plan is checked (:func:`.invariants.check_plan`) before any host runs it, so a plan that
    drops or repeats a sample, breaks the cap or the interleaving group stops here, naming the
    planner, on every rank alike (every rank plans the same). The built-in planners are not
    re-checked on every step: their invariants are asserted where they are made and tested.

    Raises:
        PlanInvariantError: A registered planner's plan broke a guarantee.
    """
    if not isinstance(config, PlannerConfig):
        raise DynBatchTypeError(f"config must be a PlannerConfig, got {type(config).__name__}.")
    planner = get_planner(config.planner)
    plan = planner(samples, config)
    if _BUILT_IN.get(config.planner) is not planner:
        from .invariants import PlanInvariantError, check_plan  # invariants imports the plans

        try:
            check_plan(plan, samples, config)
        except PlanInvariantError as error:
            found = str(error).split("\n", 1)[-1].strip().replace("\n  ", "; ")
            raise PlanInvariantError(
                f"planner {config.planner!r} made a plan that breaks its guarantees: {found}; "
                f"fix the planner, or plan with the default ({DEFAULT_PLANNER!r})."
            ) from None
    return plan


def plan_schedule(
    lengths: Sequence[int],
    rollout_ids: Optional[Sequence[Any]] = None,
    prompt_lengths: Optional[Sequence[Optional[int]]] = None,
    *,
    config: PlannerConfig,
) -> Plan:
    """Plan every optimizer step of a batch of samples, with the planner ``config.planner`` names.

    Args:
        lengths: Total token length of every sample (prompt + response).
        rollout_ids: One id (str or int) per sample; samples sharing an id (a multi-turn trajectory,
            a GRPO prompt group) always land in the same step. ``None``: each sample its own rollout.
        prompt_lengths: Prompt tokens per sample, for the cost model's response term.
        config: The parallel layout, token cap, layout, cost model, oversize policy and planner
            (``PlannerConfig.planner``, ``dynbatch`` by default: :func:`.planner.plan_samples`).

    Returns:
        The :class:`Plan`; ``plan.steps[s].ranks[r][m]`` lists the global sample indices of
        micro-batch ``m`` on DP rank ``r`` in step ``s`` (``()`` is a placeholder).

    Raises:
        ValueError: on bad lengths, mismatched ids or prompt lengths (see :class:`SampleSet`), an
            oversize sample under ``oversize_samples="error"``, or cost weights that overflow.
        PlanInvariantError: a planner registered from outside made a plan that breaks a guarantee.
    """
    if not isinstance(config, PlannerConfig):
        raise DynBatchValueError(f"config must be a PlannerConfig, got {type(config).__name__}.")
    return run_planner(SampleSet.build(lengths, rollout_ids, prompt_lengths), config)


# -- adapters --------------------------------------------------------------------------------------


def ranks_planner(scheduler: RanksScheduler, *, layout: Optional[str] = None) -> Planner:
    """A planner from a scheduler of one step's ranks.

    The planner splits the samples into the config's steps (whole rollouts, in order), applies
    the oversize policy as the planner does (``error`` refuses, ``truncate`` hands the scheduler
    the cut lengths), calls ``scheduler`` on each step's lengths with local indices, and describes
    the result with :func:`plan_from_ranks`. ``layout`` overrides the config's (a scheduler of
    padded ``[B, S]`` rows says ``padded``).
    """

    if not callable(scheduler):
        raise DynBatchValueError(
            f"ranks_planner: scheduler={scheduler!r} must be callable as scheduler(lengths, "
            "rollout_keys, config) -> ranks[r][m] (indices local to the step)."
        )
    try:  # a probe: a two-argument scheduler was a bare TypeError at the first plan
        inspect.signature(scheduler).bind(None, None, None)
    except TypeError as error:
        raise DynBatchValueError(
            f"ranks_planner: {getattr(scheduler, '__name__', scheduler)!r} cannot be called as "
            f"scheduler(lengths, rollout_keys, config) ({error}); take the three arguments."
        ) from None
    except ValueError:  # no signature to read (a builtin): called as it is
        pass

    def planner(samples: SampleSet, config: PlannerConfig) -> Plan:
        kept = _apply_oversize_policy(samples, config)
        steps = []
        for _, items in samples.steps(config.rollouts_per_step):
            lengths = [kept.get(i, samples.lengths[i]) for i in items]
            keys = [samples.rollout_keys[i] for i in items]
            local = _checked_ranks(scheduler(lengths, keys, config), len(items), config.planner)
            steps.append([[[items[j] for j in mb] for mb in rank] for rank in local])
        return plan_from_ranks(steps, samples, config, layout=layout, kept=kept)

    planner.__name__ = getattr(scheduler, "__name__", "ranks_planner")
    planner.__doc__ = scheduler.__doc__
    return planner


def _checked_ranks(local: Any, count: int, name: str) -> List[List[List[int]]]:
    """A scheduler's ``ranks[r][m]`` of one step's ``count`` samples, as lists of their local
    indices: whole numbers in ``range(count)`` (not bools, not negative), at least one
    micro-batch where there are samples. Anything else is a broken plan, named (a probe: an index
    out of range or a string was a bare ``IndexError`` / ``TypeError`` traceback, no micro-batch
    a ``ZeroDivisionError``, ``-1`` and ``True`` silently read as samples)."""
    from .invariants import PlanInvariantError  # invariants imports the plans

    def broken(what: str) -> PlanInvariantError:
        return PlanInvariantError(
            f"planner {name!r}: its scheduler returned {what}; it must return ranks[r][m], "
            f"lists of sample indices 0..{count - 1} local to the step, each sample once; fix "
            f"the planner, or plan with the default ({DEFAULT_PLANNER!r})."
        )

    if not isinstance(local, (list, tuple)) or not all(
        isinstance(rank, (list, tuple)) and all(isinstance(mb, (list, tuple)) for mb in rank)
        for rank in local
    ):
        raise broken(f"{type(local).__name__} {str(local)[:80]!r}, not ranks of micro-batches")
    bad = [
        j
        for rank in local
        for mb in rank
        for j in mb
        if isinstance(j, bool) or not isinstance(j, numbers.Integral) or not 0 <= j < count
    ]
    if bad:
        raise broken(f"{len(bad)} index(es) that are no sample of the step ({bad[:5]!r})")
    if count and not any(rank for rank in local):
        raise broken(f"no micro-batch for its {count} sample(s)")
    return [[[int(j) for j in mb] for mb in rank] for rank in local]


def plan_from_ranks(
    steps: Sequence[StepRanks],
    samples: SampleSet,
    config: PlannerConfig,
    *,
    layout: Optional[str] = None,
    kept: Optional[Dict[int, int]] = None,
) -> Plan:
    """Describe any scheduler's ``steps[s][r][m]`` (global sample indices) as a :class:`Plan`.

    Each step gets the uniform shape its micro-batches need: ``packed``, one row (``B = 1``) as
    long as its fullest micro-batch; ``padded``, ``B`` rows of its longest sample, ``B`` the most
    samples in a micro-batch. Statistics are computed as the planner computes them, so a plan from
    another scheduler reads like ours; a scheduler that exceeds the cap is described, not
    corrected (:func:`.invariants.check_plan` reports it). ``kept``: sample -> kept length of
    samples cut by the ``truncate`` policy.
    """
    layout = layout or config.layout
    kept = dict(kept or {})
    parallel = config.parallel
    multiple, cap = parallel.sample_multiple, config.token_cap
    lengths = [kept.get(i, length) for i, length in enumerate(samples.lengths)]
    sizes = [round_up(length, multiple) for length in lengths]
    responses = [max(0, n - p) for n, p in zip(lengths, samples.prompt_lengths, strict=True)]
    step_plans = []
    for s, ranks in enumerate(steps):
        counts = {len(rank) for rank in ranks}
        if len(counts) != 1 or len(ranks) != parallel.dp_size:
            raise DynBatchValueError(
                f"step {s}: the planner gave {len(ranks)} rank(s) with micro-batch counts "
                f"{sorted(counts)}; every one of dp_size={parallel.dp_size} ranks must run the same "
                "count (pad the shorter ranks with empty micro-batches: placeholders)."
            )
        step_plans.append(
            _step_plan(ranks, samples, config, layout, lengths, sizes, responses, kept)
        )
    return Plan(
        steps=tuple(step_plans),
        stats=PlanStats.from_steps(step_plans, num_samples=len(samples), dp_size=parallel.dp_size),
        layout=layout,
        sample_multiple=multiple,
        token_cap=cap,
        dp_size=parallel.dp_size,
    )


def _step_plan(
    ranks: StepRanks,
    samples: SampleSet,
    config: PlannerConfig,
    layout: str,
    lengths: Sequence[int],
    sizes: Sequence[int],
    responses: Sequence[int],
    kept: Dict[int, int],
) -> StepPlan:
    multiple, cap, cost = config.parallel.sample_multiple, config.token_cap, config.cost
    mbs = [tuple(mb) for rank in ranks for mb in rank]
    items = sorted(i for mb in mbs for i in mb)
    row_lengths: Tuple[Tuple[int, ...], ...] = ()
    if layout == "packed":
        batch = 1
        seq_length = max([sum(sizes[i] for i in mb) for mb in mbs] + [multiple])
        if config.variable_row_lengths:
            seq_length, row_lengths = _variable_rows(ranks, sizes, config)
    else:
        batch = max([len(mb) for mb in mbs] + [1])
        seq_length = max([sizes[i] for i in items] + [multiple])

    rank_tokens = [sum(lengths[i] for mb in rank for i in mb) for rank in ranks]
    # Each micro-batch computes its own row where rows vary (a probe: the longest row made
    # every rank of a peer's plan look equal, dp_imbalance_computed 1.0 for 300 against 192).
    own, computed = rank_costs(
        cost, layout, seq_length, batch, ranks, lengths, sizes, responses, row_lengths
    )
    real_tokens = sum(rank_tokens)
    oversize = tuple(i for i in items if sizes[i] > cap)
    regular = sum(sizes[i] for i in items) - sum(sizes[i] for i in oversize)
    truncated = tuple(i for i in items if i in kept)
    num_microbatches = len(ranks[0])
    return StepPlan(
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=batch,
        ranks=tuple(tuple(tuple(mb) for mb in rank) for rank in ranks),
        num_rollouts=len({samples.rollout_keys[i] for i in items}),
        num_placeholders=sum(1 for mb in mbs if not mb),
        real_tokens=real_tokens,
        # With variable rows a micro-batch computes its own row, as the planner's fill counts.
        fill=real_tokens
        / (
            sum(map(sum, row_lengths))
            if row_lengths
            else len(ranks) * num_microbatches * batch * seq_length
        ),
        dp_imbalance=imbalance(rank_tokens),
        dp_imbalance_cost=imbalance(own),
        oversize_samples=oversize,
        lower_bound_microbatches=len(oversize) + ceil_div(regular, cap),
        truncated_samples=truncated,
        truncated_tokens=sum(samples.lengths[i] - kept[i] for i in truncated),
        kept_lengths=tuple((i, kept[i]) for i in truncated),
        sample_lengths=tuple((i, samples.lengths[i]) for i in sorted(items)),
        dp_imbalance_computed=imbalance(computed),
        row_lengths=row_lengths,
        idle_ranks=sum(1 for rank in ranks if not any(rank)),
    )


def _variable_rows(
    ranks: StepRanks, sizes: Sequence[int], config: PlannerConfig
) -> Tuple[int, Tuple[Tuple[int, ...], ...]]:
    """``(seq_length, row_lengths)`` of a packed step whose micro-batches run their own rows, by
    the planner's one rule (:func:`.step_search.variable_rows`); ``seq_length`` is the longest row.
    """
    loads = [sum(sizes[i] for i in mb) for rank in ranks for mb in rank]
    flat = iter(
        variable_rows(
            loads,
            config.variable_row_multiple,
            config.token_cap,
            config.memory,
            config.parallel.sample_multiple,
        )
    )
    rows = tuple(tuple(next(flat) for _ in rank) for rank in ranks)
    return max(row for rank in rows for row in rank), rows


# -- the built-in planners -------------------------------------------------------------------------


def _oversize_alternative(config: PlannerConfig, seq_length: int) -> str:
    """What the default planner needs besides, where the longest sample is over the cap under
    ``error`` (it refuses the sample too: a probe's named fix was refused)."""
    if config.oversize_samples != "error" or seq_length <= config.token_cap:
        return ""
    way = config.oversize_way(
        ("allow", "it runs an oversize sample alone"), ("truncate", "it cuts it to the cap")
    )
    # ", or pass --oversize-samples allow (...)" read as " with --oversize-samples allow (...)".
    return way.replace(", or pass ", " with ", 1).replace(", or set ", " with ", 1)


def _fixed(samples: SampleSet, config: PlannerConfig) -> Plan:
    """Megatron's stock batching under the same budget: every sample padded to the longest (rounded
    to the sample multiple), ``micro_batch_size = cap // seq_length`` rows, arrival order."""
    seq_length = round_up(max(samples.lengths), config.parallel.sample_multiple)
    if config.layout != required_layout("fixed"):
        # Every change it needs at once (probes: the layout named, then variable rows refused
        # with it; or then the cap refused).
        fixes = ["pass --dynamic-batch-layout padded"]
        if config.variable_row_lengths:
            fixes.append("drop --variable-seq-lengths (its rows are all seq_length)")
        if seq_length > config.token_cap:
            fixes.append(
                f"raise {config.cap_to_hold(seq_length)} (it pads every sample to the longest, "
                f"{seq_length} tokens)"
            )
        raise DynBatchValueError(
            f"planner 'fixed' is Megatron's padded [micro_batch_size, seq_length] batching, but "
            f"layout={config.layout!r}; {' and '.join(fixes)} (or pick planner "
            f"{DEFAULT_PLANNER!r}{_oversize_alternative(config, seq_length)})."
        )
    if seq_length > config.token_cap:
        # Megatron's stock batching has no oversize policy: say so where one was asked for, or
        # the user reads the refusal as the policy not working.
        ignored = (
            f" (the oversize policy, here {config.oversize_samples}, applies to planner "
            f"{DEFAULT_PLANNER!r} only)"
            if config.oversize_samples != "error"
            else ""
        )
        raise DynBatchValueError(
            f"planner 'fixed' pads every sample to the longest ({seq_length} tokens after "
            f"rounding), over the token cap {config.token_cap} ({config.cap_source}){ignored}; "
            f"raise {config.cap_to_hold(seq_length)} or pick planner {DEFAULT_PLANNER!r}"
            + (
                _oversize_alternative(config, seq_length) + "."
                if config.oversize_samples == "error"
                else " (it runs an oversize sample alone, or cuts it with --oversize-samples "
                "truncate)."
            )
        )
    return plan_fixed_samples(
        samples,
        dp_size=config.parallel.dp_size,
        micro_batch_size=config.token_cap // seq_length,
        seq_length=seq_length,
        rollouts_per_step=config.rollouts_per_step,
        microbatch_multiple=config.parallel.microbatch_multiple,
        token_cap=config.token_cap,
        sample_multiple=config.parallel.sample_multiple,
        cost=config.cost,
    )


#: This package's planners (run_planner checks every other one's plans).
_BUILT_IN: Dict[str, Planner] = {
    DEFAULT_PLANNER: plan_samples,
    # The same function: it reads PlannerConfig.planner to plan thoroughly (.spec.THOROUGH_PLANNER).
    THOROUGH_PLANNER: plan_samples,
    "fixed": _fixed,
}
for _name, _planner in _BUILT_IN.items():
    register_planner(_name, _planner)
