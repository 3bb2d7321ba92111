"""Every trainer we run inside, as a record in code, and the one entry that plans a host's step.

A host (Megatron-LM, slime, SkyRL, verl, ...) is a :class:`Host`: its option names mapped to our
settings, the keys that set its budget, whether it plans the whole step (``global``) or each DP
rank's own shard (``sharded``), what its budget counts and what it does with a sample over the
budget. Everything that checks a host's input goes through the
functions here, so every host's errors are worded in its own option names and no integration
keeps its own copy of a budget, length or oversize check:

* :func:`host_config`: the host's option values -> the planner's config (the budget checked once,
  an error naming the host's key);
* :func:`check_host_lengths`: every sample a positive integer (naming the rank, the sample and the
  host's own words for what a sample is);
* :func:`check_host_oversize`: a sample over the budget refused, warned about or allowed, as the
  host means it, naming the host's budget key;
* :func:`check_host_planner`: a planner named in the host's key exists and plans the rows the
  host runs, at start-up;
* :func:`plan_host_step`: the three checks, the plan (every DP rank's shard for a ``sharded``
  host) and the plan checker (:func:`megatron_dynbatch.planning.check_plan`, every plan kind).

Adding a trainer is a record in :data:`HOSTS`, a placeholder builder, a restore step and a patch
(``docs/integrating.md``). Standard library, the pure planner and the config only: hosts validate
their configs on the driver, before any worker or torch work.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import warnings
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    List,
    Literal,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from megatron_dynbatch.config import FLAGS, config_from_mapping
from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import (
    OversizeSampleWarning,
    ParallelLayout,
    PlannerConfig,
    check_plan,
    round_up,
)
from megatron_dynbatch.planning.samples import as_sequence
from megatron_dynbatch.planning.sharded import ShardedPlan, plan_rank_shards, sharded_plan
from megatron_dynbatch.planning.spec import (
    ATTENTION_CROSSOVER_7B,
    DEFAULT_PLANNER,
    LAYOUT_FLAGS,
    MAX_TOKENS,
    as_int,
    check_int,
    layout_flags,
    require_config,
    setting_flags,
    tokens_padded,
    without_field_hints,
)

__all__ = [
    "HOSTS",
    "MEGATRON_LM",
    "NEMO_RL",
    "SKYRL",
    "SLIME",
    "VERL",
    "Host",
    "check_host_budget",
    "check_host_lengths",
    "check_host_oversize",
    "check_host_planner",
    "host_config",
    "plan_host_step",
    "register_host",
]

#: ``global``: the host hands every rank the whole step, samples go to any DP rank
#: (:func:`~megatron_dynbatch.planning.plan_schedule`); ``sharded``: the host dispatched each DP
#: rank its shard before we see it, samples stay on their rank
#: (:func:`~megatron_dynbatch.planning.sharded.plan_rank_shards`).
Planning = Literal["global", "sharded"]
#: ``padded``: the budget caps a micro-batch's samples padded to the THD alignment (ours);
#: ``real``: the host's own check counts a sample's real tokens, so a sample whose real length is
#: within the budget is accepted even where its alignment padding takes it over (it runs alone).
BudgetCounts = Literal["padded", "real"]
#: What the host does with a sample over its budget: ``error`` refuses the step, ``allow`` runs it
#: alone over the budget (``warn``: and says so once), ``option``: the host's own option decides.
OversizePolicy = Literal["error", "allow", "warn", "option"]


@dataclass(frozen=True, kw_only=True)
class Host:
    """One trainer, as megatron_dynbatch meets it."""

    name: str
    """How messages name the trainer (``"verl"``); also its key in :data:`HOSTS`."""
    switch: str
    """The host's option that turns megatron_dynbatch on, as a user types it."""
    fallback: str
    """The documented way back to the host's own micro-batching (to compare or fall back)."""
    options: Mapping[str, str]
    """The host's option name -> :class:`~megatron_dynbatch.config.DynBatchConfig` field: the
    table :func:`~megatron_dynbatch.config.config_from_mapping` reads."""
    fixed: Mapping[str, Any] = field(default_factory=dict)
    """Config fields the host decides itself (its layout, its oversize policy)."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """The host's default of an option it does not set (by its option name), where it differs
    from ours: slime's ``oversize_samples`` is ``allow``, its own rule."""
    keys: Mapping[str, str]
    """:class:`~megatron_dynbatch.config.DynBatchConfig` field -> the key as the user sets it,
    for messages. ``max_tokens_per_gpu`` is required; ``log_probs_max_tokens_per_gpu`` names the
    forward-only budget where the host has one."""
    planning: Planning
    """Whether the host plans the whole step or each DP rank's shard (see :data:`Planning`)."""
    budget_counts: BudgetCounts = "padded"
    """What the host's budget counts (see :data:`BudgetCounts`)."""
    budget_times_cp: bool = True
    """The budget is per GPU and a micro-batch holds ``cp_size`` times it (split over the CP
    ranks); ``False``: the budget caps the whole micro-batch, whatever the CP size (SkyRL)."""
    oversize: OversizePolicy
    """What the host does with a sample over its budget (see :data:`OversizePolicy`)."""
    layout_flags: Union[str, Mapping[str, str]]
    """How messages name its parallel sizes: a key of
    :data:`~megatron_dynbatch.planning.spec.LAYOUT_FLAGS`, or (a host registered from outside the
    package) its own mapping of ``dp_size`` / ``pp_size`` / ``vpp_size`` / ``tp_size`` /
    ``cp_size`` / ``microbatch_group_size_per_vp_stage`` to its option names (those it leaves out
    keep Megatron-LM's flag names)."""
    sample: str = "sample"
    """What the host calls a sample in messages (a global host numbers them by their position
    in the step, a sharded one within their DP rank)."""

    def __post_init__(self) -> None:
        # A host is registered from outside the package too (docs/integrating.md): a bad record
        # is that trainer's bad input, refused by what is wrong and what is allowed.
        def refuse(problem: str) -> None:
            raise DynBatchValueError(f"Host {self.name!r}: {problem}")

        if "max_tokens_per_gpu" not in self.keys:
            refuse("keys must name its budget key: keys={'max_tokens_per_gpu': '<its option>'}.")
        for what, names in (
            ("options' values", set(self.options.values())),
            ("keys", set(self.keys)),
        ):
            unknown = sorted(names - set(FLAGS))
            if unknown:
                refuse(
                    f"{what} name unknown config fields {unknown}; the fields are {sorted(FLAGS)}."
                )
        if "max_tokens_per_gpu" not in dict(self.options).values():
            # host_config reads the budget through this option (a probe: a bare StopIteration).
            refuse(
                "options must map its budget option to 'max_tokens_per_gpu', e.g. "
                "options={'tokens_per_mb': 'max_tokens_per_gpu'}."
            )
        for what, value, allowed in (
            ("planning", self.planning, ("global", "sharded")),
            ("budget_counts", self.budget_counts, ("padded", "real")),
            ("oversize", self.oversize, ("error", "allow", "warn", "option")),
        ):
            if value not in allowed:
                refuse(f"{what}={value!r} is not one of {allowed}.")
        if isinstance(self.layout_flags, str):
            if self.layout_flags not in LAYOUT_FLAGS:
                refuse(
                    f"layout_flags={self.layout_flags!r} is not one of {sorted(LAYOUT_FLAGS)}; "
                    "or pass a mapping of dp_size / pp_size / ... to the host's option names."
                )
        else:
            unknown = set(self.layout_flags) - set(LAYOUT_FLAGS["Megatron-LM"])
            if unknown:
                refuse(
                    f"layout_flags names unknown sizes {sorted(unknown)}; the sizes are "
                    f"{sorted(LAYOUT_FLAGS['Megatron-LM'])}."
                )
            object.__setattr__(
                self, "layout_flags", {**LAYOUT_FLAGS["Megatron-LM"], **self.layout_flags}
            )
        fixed = dict(self.fixed)
        if self.oversize in ("allow", "warn"):
            # check_host_oversize accepts (or warns about) a sample over the budget; the planner
            # must then run it alone, not refuse it (a probe: a registered host's record said
            # "allow", and plan_schedule refused the sample, naming our --oversize-samples).
            policy = fixed.setdefault("oversize_samples", "allow")
            if policy != "allow":
                refuse(
                    f"oversize={self.oversize!r} runs a sample over the budget alone, but "
                    f"fixed={{'oversize_samples': {policy!r}}} has the planner "
                    + ("refuse" if policy == "error" else "cut")
                    + " it; drop that entry (or set oversize='error' to refuse such samples)."
                )
        object.__setattr__(self, "options", dict(self.options))
        object.__setattr__(self, "fixed", fixed)
        object.__setattr__(self, "defaults", dict(self.defaults))
        object.__setattr__(self, "keys", dict(self.keys))

    def option(self, field_name: str) -> Optional[str]:
        """The host's option that sets config field ``field_name`` (``None``: it has none)."""
        return next((o for o, f in self.options.items() if f == field_name), None)

    def key(self, field_name: str, *, forward_only: bool = False) -> str:
        """The host's key for a config field (the forward-only budget falls back to training's)."""
        if forward_only and field_name == "max_tokens_per_gpu":
            return self.keys.get("log_probs_max_tokens_per_gpu", self.keys[field_name])
        if field_name in self.keys:
            return self.keys[field_name]
        # A setting the host names by its option alone: the option, not our flag (a probe: a
        # registered host's oversize refusal said "or --oversize-samples allow").
        option = self.option(field_name)
        return option if option is not None else FLAGS[field_name]

    def flags(self):
        """Errors raised inside that name parallel sizes also name the host's options."""
        if isinstance(self.layout_flags, str):
            return layout_flags(self.layout_flags)
        return setting_flags(self.layout_flags, tool=self.name)


MEGATRON_LM = Host(
    name="Megatron-LM",
    switch="--use-dynamic-batch-size",
    fallback="drop --use-dynamic-batch-size (Megatron-LM's fixed --micro-batch-size)",
    options={field_name: field_name for field_name in FLAGS},
    keys=dict(FLAGS),
    planning="global",
    oversize="option",
    layout_flags="Megatron-LM",
)

SLIME = Host(
    name="slime",
    switch="--use-dynamic-batch-size",
    fallback="--use-slime-dynamic-batch-size (slime's own dynamic batching, patches applied)",
    options={
        "max_tokens_per_gpu": "max_tokens_per_gpu",
        "log_probs_max_tokens_per_gpu": "log_probs_max_tokens_per_gpu",
        "oversize_samples": "oversize_samples",
        "max_memory_gib": "max_memory_gib",
        "dynamic_batch_planner": "planner",
    },
    fixed={"layout": "packed"},
    defaults={"oversize_samples": "allow"},
    keys={
        "max_tokens_per_gpu": "--max-tokens-per-gpu",
        "log_probs_max_tokens_per_gpu": "--log-probs-max-tokens-per-gpu",
        "oversize_samples": "--oversize-samples",
        # Registered by patch 0005; read by integrations/slime/memory.py (GiB, no ``auto``).
        "max_memory_gib": "--max-memory-gib",
        # Registered by patch 0005 (Megatron-LM's spelling): the planner by name, and one
        # micro-batch's fixed cost (read by integrations/slime/config.py).
        "planner": "--dynamic-batch-planner",
        "cost_microbatch_overhead": "--dynamic-batch-cost-microbatch-overhead",
    },
    planning="global",
    oversize="option",
    layout_flags="slime",
)

SKYRL = Host(
    name="SkyRL",
    switch="trainer.use_dynamic_batch_size=true",
    fallback="trainer.use_dynamic_batch_size=false (SkyRL's TokenBasedBatchIterator)",
    options={
        "max_tokens_per_microbatch": "max_tokens_per_gpu",
        "dynamic_batch_planner": "planner",
    },
    # Its padding-free forward packs a micro-batch's real tokens (``remove_microbatch_padding``,
    # on by default, with ``variable_seq_lengths``): each micro-batch runs a row of its own
    # length (planned so: ``plan_skyrl_minibatch`` asks for variable rows), attention per sample.
    # A single long sample runs alone, as in SkyRL's own batching.
    fixed={
        "layout": "packed",
        "oversize_samples": "allow",
        "cost_attention_weight": 1.0 / ATTENTION_CROSSOVER_7B,
    },
    keys={
        "max_tokens_per_gpu": "trainer.max_tokens_per_microbatch",
        # Added by patches/skyrl/0001 beside the switch; checked in validate_cfg.
        "planner": "trainer.dynamic_batch_planner",
        "max_memory_gib": "trainer.max_memory_gib",
        # One micro-batch's fixed cost (patch 0001; read by integrations/skyrl/worker.py).
        "cost_microbatch_overhead": "trainer.dynamic_batch_cost_microbatch_overhead",
    },
    planning="sharded",
    budget_counts="real",
    budget_times_cp=False,
    oversize="allow",
    layout_flags="SkyRL",
)

VERL = Host(
    name="verl",
    switch="actor_rollout_ref.actor.megatron.use_dynamic_batch_size=true",
    fallback="actor_rollout_ref.actor.megatron.use_dynamic_batch_size=false (verl's "
    "rearrange_micro_batches)",
    options={"max_token_len_per_gpu": "max_tokens_per_gpu"},
    # A sample over verl's budget is refused by check_host_oversize, before planning; a sample
    # whose real tokens fit but whose alignment padding does not runs alone (stock verl accepts it).
    # Its engine runs attention per sample (THD) or per row (BSHD), costed as a 7B-class model's:
    # the engine plans before it could calibrate.
    fixed={"oversize_samples": "allow", "cost_attention_weight": 1.0 / ATTENTION_CROSSOVER_7B},
    keys={
        "max_tokens_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        # The actor's log-prob pass; the reference's and the critic's keys are in
        # integrations/verl/config.py (BUDGET_KEYS), which names each engine's and pass's own.
        "log_probs_max_tokens_per_gpu": "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        # One dict option holds megatron_dynbatch's settings (the critic's: critic.megatron...).
        "max_memory_gib": "actor_rollout_ref.actor.megatron.dynbatch.max_memory_gib",
        "planner": "actor_rollout_ref.actor.megatron.dynbatch.planner",
        "cost_microbatch_overhead": (
            "actor_rollout_ref.actor.megatron.dynbatch.cost_microbatch_overhead"
        ),
    },
    planning="sharded",
    budget_counts="real",
    oversize="error",
    layout_flags="verl",
)

NEMO_RL = Host(
    name="NeMo-RL",
    switch="policy.megatron_cfg.dynbatch.enabled=true",
    fallback="policy.megatron_cfg.dynbatch.enabled=false (NeMo-RL's own sequence packing)",
    # train_mb_tokens / logprob_mb_tokens live in policy.sequence_packing, planner beside the
    # switch in policy.megatron_cfg.dynbatch (integrations/nemo_rl/plan.py reads both).
    options={
        "train_mb_tokens": "max_tokens_per_gpu",
        "logprob_mb_tokens": "log_probs_max_tokens_per_gpu",
        "planner": "planner",
    },
    # Its sequence packing runs every micro-batch as one THD row (attention per sample), and its
    # budget is a hard cap (its packer refuses a longer sample too). The driver plans before any
    # model exists, so attention is costed as a 7B-class model's.
    fixed={
        "layout": "packed",
        "oversize_samples": "error",
        "cost_attention_weight": 1.0 / ATTENTION_CROSSOVER_7B,
    },
    keys={
        "max_tokens_per_gpu": "policy.sequence_packing.train_mb_tokens",
        "log_probs_max_tokens_per_gpu": "policy.sequence_packing.logprob_mb_tokens",
        "planner": "policy.megatron_cfg.dynbatch.planner",
        # Beside the planner; read by integrations/nemo_rl/plan.py (nemo_rl_planner_config).
        "cost_microbatch_overhead": "policy.megatron_cfg.dynbatch.cost_microbatch_overhead",
    },
    planning="global",
    # The budget caps the whole packed row of samples padded to
    # make_sequence_length_divisible_by, whatever the CP size.
    budget_times_cp=False,
    oversize="error",
    layout_flags="NeMo-RL",
)

#: Every host, by name: a check that "every host does X" is a loop over this.
HOSTS: Dict[str, Host] = {host.name: host for host in (MEGATRON_LM, SLIME, SKYRL, VERL, NEMO_RL)}


def register_host(host: Host, *, replace: bool = False) -> Host:
    """Add a trainer's record to :data:`HOSTS` from outside the package; returns ``host``.

    A trainer that is not built in (``examples/minimal_host.py``) describes itself with a
    :class:`Host` (its option names, the budget key of each pass, what its budget counts, how it
    plans) and registers it once at import; every check of this module then words its errors in
    that trainer's keys. ``replace=True`` overrides a record of the same name (a test, a newer
    version of the trainer's integration); otherwise a second record of one name is refused.
    """
    if not isinstance(host, Host):
        raise DynBatchValueError(
            f"register_host needs a megatron_dynbatch.integrations.hosts.Host, got {host!r}."
        )
    if host.name in HOSTS and not replace and HOSTS[host.name] != host:
        raise DynBatchValueError(
            f"a host named {host.name!r} is already registered; pick another name or pass "
            "replace=True."
        )
    HOSTS[host.name] = host
    return host


def check_host_budget(host: Host, budget: Any, *, forward_only: bool = False) -> int:
    """The budget as a plain positive ``int`` (numpy integers accepted), or a
    ``DynBatchValueError`` naming the host's key."""
    return check_budget(
        budget, host.key("max_tokens_per_gpu", forward_only=forward_only), host.switch
    )


def check_budget(budget: Any, key: str, switch: str) -> int:
    """A token budget set as ``key`` with ``switch`` on, as a plain positive ``int`` (numpy
    integers accepted), or a ``DynBatchValueError`` naming ``key`` (for a host whose budget keys
    are more than :class:`Host` records: verl's per-engine keys)."""
    if isinstance(budget, numbers.Integral) and not isinstance(budget, bool):
        budget = int(budget)
    if budget is None:
        raise DynBatchValueError(
            f"{key}=null: {switch} needs a token budget; set {key} to the tokens of one "
            "micro-batch (e.g. 8192)."
        )
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise DynBatchValueError(
            f"{key}={budget!r} must be a whole number of tokens with {switch}; set it to the "
            "tokens of one micro-batch (e.g. 8192)."
        )
    if budget < 1:
        raise DynBatchValueError(
            f"{key}={budget} must be > 0 with {switch}; set it to the tokens of one "
            "micro-batch (e.g. 8192)."
        )
    if budget > MAX_TOKENS:
        # The planner refuses it when it builds its config: at the first step, in its words.
        raise DynBatchValueError(
            f"{key}={budget} is above the supported maximum {MAX_TOKENS} (2**40) tokens; set it "
            "to the tokens of one micro-batch (e.g. 8192)."
        )
    return budget


def check_budget_holds_a_sample(host: Host, budget: int, parallel: Any, key: str) -> None:
    """A budget (as the host's users set it) that holds one padded sample of the layout, or a
    ``DynBatchValueError`` naming ``key`` and the least that does: every sample is padded to
    ``parallel.sample_multiple`` (tp, 2 x cp), and a budget under it plans nothing. Told in the
    host's terms: a host whose budget caps the whole micro-batch (SkyRL) needs the multiple
    itself, not the planner's per-GPU share (the planner said ``max_tokens_per_gpu=2 (x
    cp_size=2)`` and a minimum that was refused again)."""
    multiple = parallel.sample_multiple
    cp = parallel.cp_size
    least = multiple if not host.budget_times_cp else -(-multiple // cp)
    if budget < least:
        raise DynBatchValueError(
            f"{key}={budget} is smaller than one padded sample: {host.name} pads every sample to "
            f"a multiple of {multiple} (tensor parallel size {parallel.tp_size}, context parallel "
            f"size {cp}); raise {key} to at least {least}."
        )


def host_size(value: Any, key: str, default: int = 1) -> int:
    """A parallel size or count read from a host's config (``None`` or absent: ``default``), as
    a plain ``int`` >= 1 (:func:`~megatron_dynbatch.planning.spec.check_int`), or a
    ``DynBatchValueError`` naming ``key`` (``int("two")`` was a bare ``ValueError``, and
    ``0 or 1`` read a size of 0 as 1)."""
    if value is None:
        return default
    return check_int(key, value, 1, f"set {key} to a whole number >= 1 (or leave it out: 1).")


def check_overhead(value: Any, setting: str, example: str) -> Optional[float]:
    """One micro-batch's fixed cost as a host sets it (``None``: not given, the planner assumes
    one), as a ``float``, or a ``DynBatchValueError`` quoting ``setting`` (the host's key with the
    value, as its users type it) and ``example`` (the same key with a value that works)."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        # The planner sums a step's costs with headroom (spec.check_cost_is_finite): a value it
        # overflows passed here and was refused at the first step, in our flags' words (a probe).
        or not math.isfinite(value * 1e9)
        or value < 0
    ):
        raise DynBatchValueError(
            f"{setting} must be a finite number >= 0 (and below 1e299): the fixed cost of one "
            "micro-batch (kernel "
            "launches, pipeline send/receive, Python) in tokens of one GPU's linear work, e.g. "
            f"{example} (2% of a 16384-token row's linear work); drop it to let the planner "
            "assume 2% of a full row."
        )
    return float(value)


def check_host_planner(host: Host, name: Any, layout: Optional[str]) -> None:
    """A planner named in ``host``'s planner key, at start-up: registered, and planning the rows
    the host runs (``layout``; ``None`` where it runs either). Without this a planner of the other
    layout (``fixed`` plans padded rows) passed the start-up and was refused at the first step.

    Raises:
        DynBatchValueError: naming the host's key, the value and a planner that works.
    """
    # The planner's registry imports the whole planner: only where a planner is named.
    from megatron_dynbatch.planning.registry import DEFAULT_PLANNER, get_planner, required_layout

    key = host.key("planner")
    setting = f"{key} {name}" if key.startswith("--") else f"{key}={name!r}"
    if not isinstance(name, str):
        raise DynBatchValueError(
            f"{setting} must name a registered planner, e.g. {DEFAULT_PLANNER!r}."
        )
    try:
        get_planner(name)
    except DynBatchValueError as error:
        raise DynBatchValueError(f"{setting}: {error}") from None
    required = required_layout(name)
    if layout is not None and required not in (None, layout):
        raise DynBatchValueError(
            f"{setting} plans {required} rows only, but {host.name} runs {layout} rows here: "
            f"pick planner {DEFAULT_PLANNER!r} or drop {key}."
        )


def host_config(
    host: Host,
    values: Mapping[str, Any],
    parallel: ParallelLayout,
    *,
    forward_only: bool = False,
    fixed: Optional[Mapping[str, Any]] = None,
    row_multiple: Optional[int] = None,
    memory: Optional[Any] = None,
) -> PlannerConfig:
    """The planner's config from the host's option values (``values`` keyed by its option names).

    ``fixed`` adds fields the caller decides per call (slime's cost model, verl's layout) to the
    host's own :attr:`Host.fixed`; ``memory``: the host's memory budget as a
    :class:`~megatron_dynbatch.planning.memory.MemoryLimit`, or ``None``. A ``sharded`` host plans one rank's samples: ``parallel``
    must have ``dp_size=1``.

    Raises:
        DynBatchValueError: a missing or bad budget, or one that cannot hold one padded sample of
            the layout, naming the host's key.
    """
    if host.planning == "sharded" and parallel.dp_size != 1:
        raise DynBatchValueError(
            f"{host.name} plans each DP rank's own samples: pass parallel with dp_size=1 (got "
            f"{parallel.dp_size}); the ranks are the outer list of the lengths planned."
        )
    budget_option = host.option("max_tokens_per_gpu")  # every record has one (Host.__post_init__)
    values = {**host.defaults, **{k: v for k, v in values.items() if v is not None}}
    values[budget_option] = check_host_budget(host, values.get(budget_option))
    # The budget this pass plans with, under the key that set it: a forward-only pass's own
    # budget where the host has one and it is given (an integrator's probe: the training
    # budget was checked under the forward-only key, whose named fix then changed nothing).
    checked, key = values[budget_option], host.key("max_tokens_per_gpu")
    forward_option = host.option("log_probs_max_tokens_per_gpu")
    if forward_option is not None and values.get(forward_option) is not None:
        forward_key = host.key("max_tokens_per_gpu", forward_only=True)
        values[forward_option] = check_budget(values[forward_option], forward_key, host.switch)
        if forward_only:
            checked, key = values[forward_option], forward_key
    check_budget_holds_a_sample(host, checked, parallel, key)
    cp = parallel.cp_size
    if not host.budget_times_cp and cp > 1:
        # The budget caps the whole micro-batch: the planner's per-GPU budget is 1/cp of it,
        # rounded down so the cap never exceeds it (a budget stock accepts is never refused).
        values[budget_option] = max(1, values[budget_option] // cp)
    try:
        config = config_from_mapping(
            values,
            table=host.options,
            fixed={**host.fixed, **dict(fixed or {})},
            host=f"{host.name}'s options",
        )
    except DynBatchValueError as error:
        # The message without config_from_mapping's "(in ...: option -> field)" suffix: it is
        # reworded in the host's keys, so the internal mapping says nothing to its users.
        cause = error.__cause__ if isinstance(error.__cause__, DynBatchValueError) else error
        raise DynBatchValueError(_in_host_words(host, str(cause), forward_only)) from error
    try:
        with host.flags():
            planner = config.planner_config(
                parallel, forward_only=forward_only, row_multiple=row_multiple, memory=memory
            )
    except DynBatchValueError as error:
        raise DynBatchValueError(_in_host_words(host, str(error), forward_only)) from error
    _check_planned_config(host, planner)
    # The planner's own messages (an oversize sample at plan time) name the host's budget key.
    # ... and the host's oversize option, where it has one: a record that decides the policy
    # itself names no option of ours as a way out.
    oversize = host.key("oversize_samples") if host.oversize == "option" else None
    return dataclasses.replace(planner, budget_flag=key, oversize_flag=oversize)


def _policy(host: Host, value: str) -> str:
    """The oversize policy ``value`` as the host's users set it: ``--oversize-samples allow``
    for a flag, ``policy=allow`` for a config key or option."""
    key = host.key("oversize_samples")
    return f"{key} {value}" if key.startswith("--") else f"{key}={value}"


def _check_planned_config(host: Host, config: PlannerConfig) -> None:
    """What the config's first step would refuse, refused where it is built, in the host's words
    (a probe: a sharded host took ``truncate`` and a ``fixed`` planner of packed rows here, and
    refused them at the first step, naming our flags)."""
    policy = host.option("oversize_samples")
    if host.planning == "sharded" and config.oversize_samples == "truncate":
        setting = f"{policy or 'oversize_samples'}='truncate'"
        raise DynBatchValueError(
            f"{host.name}: {setting} is refused: {host.name} plans each DP rank's own samples "
            "and trains them whole, so no sample is cut to the cap; use "
            + (f"{policy}='allow' or 'error'" if policy else "'allow' or 'error'")
            + ", or cut the samples before planning."
        )
    if config.planner != DEFAULT_PLANNER:
        check_host_planner(host, config.planner, config.layout)


def _in_host_words(host: Host, text: str, forward_only: bool) -> str:
    """Our flags in a message, replaced by the host's keys for the same settings."""
    text = without_field_hints(text)  # the host's keys name them
    for field_name, flag in FLAGS.items():
        if field_name in host.keys or field_name == "max_tokens_per_gpu":
            name = host.key(field_name, forward_only=forward_only and "max_tokens" in field_name)
            text = text.replace(flag, name)
            continue
        # A setting the host names by its option alone (a registered host without a key for
        # it): the option as the host's users pass it, for our flag and our field's "name=".
        option = host.option(field_name)
        if option is not None:
            text = re.sub(rf"(?<![\w.-]){field_name}=", f"{option}=", text.replace(flag, option))
    return text


def check_host_lengths(host: Host, lengths_per_rank: Sequence[Sequence[Any]]) -> List[List[int]]:
    """Every rank's sample lengths as plain ints, or a ``DynBatchValueError`` naming the rank and
    the sample without tokens (a ``global`` host passes one list: the whole step)."""
    # A 2-D array or tensor is a sequence of ranks; its truth value is ambiguous (a bare error).
    lengths_per_rank = as_sequence(
        f"{host.name}: lengths", lengths_per_rank, "sample lengths per DP rank, e.g. [[120, 300]]"
    )
    if not lengths_per_rank:
        raise DynBatchValueError(
            f"{host.name}: no lengths; pass one list of sample lengths per DP rank."
        )
    checked: List[List[int]] = []
    for rank, lengths in enumerate(lengths_per_rank):
        where = "" if host.planning == "global" else f"DP rank {rank} "
        lengths = as_sequence(
            f"{host.name}: {where}lengths",
            lengths,
            "sample lengths (one list per DP rank, e.g. [[120, 300], [80]])",
        )
        row = []
        for i, length in enumerate(lengths):
            # A token count is an integer, as `plan` reads it: 5.0 is refused, not read as 5.
            number = as_int(length)
            if number is None:
                raise DynBatchValueError(
                    f"{host.name}: {where}{host.sample} {i} has {length!r} tokens "
                    f"({type(length).__name__}), not an integer token count; pass the lengths "
                    "as integers (e.g. attention_mask.sum(-1).tolist())."
                )
            if number < 1:
                raise DynBatchValueError(
                    f"{host.name}: {where}{host.sample} {i} has {length!r} tokens; every sample "
                    "needs at least one (drop empty samples before training)."
                )
            row.append(number)
        checked.append(row)
    return checked


def check_host_oversize(
    host: Host,
    lengths_per_rank: Sequence[Sequence[int]],
    config: PlannerConfig,
    *,
    forward_only: bool = False,
    report_forward_only: bool = False,
) -> List[Tuple[int, int]]:
    """``(rank, index)`` of every sample over the host's budget, refused or warned about as the
    host means it (``config.oversize_samples`` under :attr:`Host.oversize` ``option``).

    A forward-only pass warns only with ``report_forward_only``: the caller's forward-only budget
    is smaller than its training budget, whose check named every sample over that one already.

    A ``real``-budget host counts a sample's real tokens here: a sample within the budget whose
    alignment padding takes it over is not oversize for the host (the planner runs it alone).

    Raises:
        DynBatchValueError: under the ``error`` policy, naming the samples, their lengths, the cap
            and the host's key to raise.
    """
    # A flat list (one rank's lengths, not nested) was a bare TypeError below: refused as
    # check_host_lengths words it. Only the first entry is looked at: the callers have checked
    # every length already (plan_host_step), and a second pass over 1M samples is not free.
    if len(lengths_per_rank) and not hasattr(lengths_per_rank[0], "__len__"):
        check_host_lengths(host, lengths_per_rank)
    multiple = config.parallel.sample_multiple
    cap = config.token_cap
    if host.budget_counts == "real":
        over = [
            (r, i) for r, ls in enumerate(lengths_per_rank) for i, n in enumerate(ls) if n > cap
        ]
    else:
        keep = config.longest_fitting
        over = [
            (r, i) for r, ls in enumerate(lengths_per_rank) for i, n in enumerate(ls) if n > keep
        ]
    if not over:
        return over
    policy = host.oversize
    if policy == "option":
        policy = "error" if config.oversize_samples == "error" else "warn"
    if policy == "allow" or (policy == "warn" and forward_only and not report_forward_only):
        return over
    key = host.key("max_tokens_per_gpu", forward_only=forward_only)
    where = (
        (lambda r, i: f"{host.sample} {i}")
        if host.planning == "global"
        else (lambda r, i: f"DP rank {r} {host.sample} {i}")
    )
    # A real-budget host counts no padding (tokens_padded with a multiple of 1 adds nothing).
    counted = 1 if host.budget_counts == "real" else multiple
    shown = ", ".join(
        f"{where(r, i)}: {tokens_padded(lengths_per_rank[r][i], counted)}" for r, i in over[:8]
    )
    more = f" (and {len(over) - 8} more)" if len(over) > 8 else ""
    cp = config.parallel.cp_size
    per_gpu = cap // cp if host.budget_times_cp else cap
    longest = max(lengths_per_rank[r][i] for r, i in over)
    need = -(-round_up(longest, 1 if host.budget_counts == "real" else multiple) // cp)
    what = (
        f"{len(over)} sample(s) exceed the token cap {cap} ({key}={per_gpu}"
        + (f" x context parallel size {cp}" if cp > 1 and host.budget_times_cp else "")
        + f"): {shown}{more}."
    )
    if policy == "warn":
        fits = f"raise {key} (to at least {need if host.budget_times_cp else longest})"
        if host.oversize == "option" and config.oversize_samples == "truncate":
            # The plan cuts them (StepPlan.kept_lengths): say so, not that they run whole.
            message = (
                f"{what} Each is cut to the cap ({_policy(host, 'truncate')}): its "
                f"tokens past {cap} are not trained; {fits} to train them whole, or set "
                f"{_policy(host, 'error')} to stop on such samples."
            )
        else:
            # One [B, S] a step (no variable rows): every micro-batch of its step, placeholders
            # included, runs that row length (a probe: the warning said only the sample ran
            # over; three micro-batches of 20-60 real tokens ran its rows too, which slime
            # rounds up to 128: "at least", a probe read "that row length" as 71).
            uniform = (
                ", and every micro-batch of its step, placeholders included, gets a row at "
                "least that long (one [B, S] a step without variable rows; the host may round "
                "it up further)"
                if host.planning == "global" and not config.variable_row_lengths
                else ""
            )
            # Only a host with an oversize option can be told to stop on them (a probe: a
            # registered "warn" host was told to set our --oversize-samples).
            stop = (
                f", or set {_policy(host, 'error')} to stop on such samples"
                if host.oversize == "option"
                else ""
            )
            message = (
                f"{what} Each runs alone in its micro-batch, over the budget{uniform}, as stock "
                f"{host.name} runs it; {fits} to stay within it{stop}."
            )
        warnings.warn(message, OversizeSampleWarning, stacklevel=3)
        return over
    fix = (
        f" or {_policy(host, 'allow')} (each runs alone, over the budget)"
        if host.oversize == "option"
        else ""
    )
    raise DynBatchValueError(
        f"{what} Raise {key} to at least {need if host.budget_times_cp else longest}, shorten "
        f"or drop the samples{fix}."
    )


def plan_host_step(
    host: Host,
    lengths_per_rank: Sequence[Sequence[Any]],
    config: PlannerConfig,
    *,
    forward_only: bool = False,
    adjust: Optional[
        Callable[
            [List[Tuple[Tuple[int, ...], ...]], List[List[int]]],
            List[Tuple[Tuple[int, ...], ...]],
        ]
    ] = None,
    placeholder_row_tokens: int = 0,
    placeholder_copies_shortest: bool = False,
) -> ShardedPlan:
    """Plan one step of a ``sharded`` host: check its lengths and oversize samples once, plan each
    rank's shard, equalise the counts, and check the plan.

    Args:
        host: The host (``planning="sharded"``).
        lengths_per_rank: ``lengths_per_rank[r][i]``: tokens of sample ``i`` on DP rank ``r`` (the
            lengths every rank gathered); a rank may hold no sample.
        config: From :func:`host_config` (``dp_size=1``).
        forward_only: Name the forward-only budget in messages.
        adjust: Changes each rank's real micro-batches before the counts are equalised (SkyRL
            fits its placeholder rows), given them and the checked lengths.
        placeholder_row_tokens: Tokens of one placeholder row the host adds to a micro-batch with
            fewer samples than the plan's rows (SkyRL), for the plan checker.
        placeholder_copies_shortest: A placeholder micro-batch is a copy of the rank's shortest
            sample (verl), and costs as much: the count every rank runs is chosen knowing it.

    Returns:
        The :class:`~megatron_dynbatch.planning.sharded.ShardedPlan` every rank derives.

    Raises:
        DynBatchValueError: bad lengths or an oversize sample the host refuses, in its words.
    """
    require_config(config, "plan_host_step")
    if host.planning != "sharded":
        raise DynBatchValueError(
            f"{host.name} plans the whole step globally: plan it with plan_schedule (or "
            "plan_samples), not plan_host_step, which plans each DP rank's own samples."
        )
    lengths = check_host_lengths(host, lengths_per_rank)
    check_host_oversize(host, lengths, config, forward_only=forward_only)
    with host.flags(), warnings.catch_warnings():
        # check_host_oversize reported them in the host's words (the planner's text names ours).
        warnings.simplefilter("ignore", OversizeSampleWarning)
        ranks, oversize = plan_rank_shards(
            lengths, config, placeholder_copies_shortest=placeholder_copies_shortest
        )
    if adjust is not None:
        ranks = adjust(ranks, lengths)
    plan = sharded_plan(ranks, oversize, config.parallel, lengths)
    check_plan(plan, lengths, config, placeholder_row_tokens=placeholder_row_tokens)
    return plan
