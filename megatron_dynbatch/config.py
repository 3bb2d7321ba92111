"""The dynamic-batching configuration: a frozen dataclass, its command-line flags and a YAML loader.

The fields, their flags, defaults and documentation come from the settings table
(:mod:`megatron_dynbatch.settings`); this module checks them and hands them to the planner.
Standard library (plus PyYAML, imported only by the loader) and the pure planner; no torch, no
megatron. :mod:`megatron_dynbatch.integrations.megatron_lm.arguments` turns Megatron's parsed arguments into a
:class:`DynBatchConfig`; ``configs/dynbatch.yaml`` lists every key with its default.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple, Union

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning.spec import (
    CostModel,
    ParallelLayout,
    PlannerConfig,
    check_int,
    setting_flags,
)
from megatron_dynbatch.settings import ATTENTION_CHOICES, REQUIRED, config_settings

__all__ = [
    "ATTENTION_CHOICES",
    "FLAGS",
    "DynBatchConfig",
    "attention_from_megatron",
    "config_from_mapping",
    "load_yaml_config",
    "megatron_setting_flags",
]

#: The config settings, one row each (:mod:`megatron_dynbatch.settings`: add a setting there).
_SETTINGS = config_settings()

#: The Megatron command-line flag of every :class:`DynBatchConfig` field (error messages name them).
FLAGS: Dict[str, str] = {row.name: row.flag for row in _SETTINGS}

#: How the planner's own checks (``PlannerConfig``, ``CostModel``) name each field they check.
_PLANNER_NAMES: Dict[str, str] = {row.name: row.check for row in _SETTINGS if row.check}
#: The fields the planner's :class:`CostModel` checks and holds: field -> its name there.
_COST_MODEL_FIELDS: Dict[str, str] = {
    name: check
    for name, check in _PLANNER_NAMES.items()
    if check in {f.name for f in dataclasses.fields(CostModel)}
}
#: Of those, the weights (floats >= 0; ``None`` where optional), stored as plain floats.
_COST_FIELDS = tuple(
    row.name for row in _SETTINGS if row.name in _COST_MODEL_FIELDS and row.parse is float
)
#: The planner's setting -> the flag that sets it (for :func:`setting_flags`); the fields checked
#: here rather than by the planner (``max_memory_gib``) have no planner name.
_SETTING_FLAGS = {_PLANNER_NAMES[name]: FLAGS[name] for name in _PLANNER_NAMES}


def megatron_setting_flags():
    """A context in which the planner's refusals name its settings by these Megatron flags, for
    what the planner checks only with the samples in hand (the cost model against the longest
    sample's row: a probe saw ``attention_weight=1e+290`` where the config's own check, for the
    cap's row, names ``--dynamic-batch-cost-attention-weight``)."""
    return setting_flags(_SETTING_FLAGS)


def attention_from_megatron(
    transformer_impl: Optional[str],
    attention_backend: Optional[str],
    layout: str,
    *,
    reference_thd: bool = False,
    core_attention: Optional[str] = None,
) -> str:
    """The cost model's attention kind of what Megatron runs (``spec.ATTENTION_KINDS``).

    Megatron's ``local`` transformer implementation, and transformer-engine's ``unfused`` /
    ``local`` backends, compute a masked softmax over the whole ``S x S`` score matrix: ``dense``,
    whatever the row holds. transformer-engine's flash / fused / auto backends run packed rows as
    THD segments (``cu_seqlens``): ``segment``; on padded rows they run each row as one causal
    sequence: ``causal``.

    Args:
        transformer_impl: ``--transformer-impl`` (``local`` or ``transformer_engine``; ``None``:
            Megatron's default, transformer-engine).
        attention_backend: ``--attention-backend`` (a name or Megatron's ``AttnBackend`` enum;
            ``None``: ``auto``).
        layout: ``packed`` or ``padded``.
        reference_thd: The same as ``core_attention="reference"`` (the retired
            ``--dynamic-batch-reference-thd-attention``).
        core_attention: The core attention the launch resolved ``--dynamic-batch-attention`` to
            (``integrations/megatron_lm/attention.py``): ``torch-varlen`` (flash varlen on packed
            THD rows, flash causal on padded rows) and ``reference`` (the reference of TE's THD
            attention, per segment as the GPU path) attend packed rows per segment (one packed
            row a micro-batch); ``transformer-engine``, ``local`` or ``None``: read from
            ``transformer_impl`` / ``attention_backend``.
    """
    if reference_thd or core_attention in ("torch-varlen", "reference"):
        return "segment" if layout == "packed" else "causal"
    impl = str(transformer_impl or "transformer_engine").lower()
    backend = str(getattr(attention_backend, "name", attention_backend) or "auto").lower()
    backend = backend.rsplit(".", 1)[-1]
    if impl == "local" or backend in ("unfused", "local"):
        return "dense"
    return "segment" if layout == "packed" else "causal"


#: The memory budgets (GiB) taken: one byte or more (a budget under it became 0 bytes, refused in
#: internal words, a probe), and at most 1e12 GiB (a larger finite one overflowed the byte count
#: into a traceback, a probe); any real GPU lies far inside.
MIN_GIB = 1e-9
MAX_GIB = 1e12
#: How a refusal words that range.
GIB_RANGE = f"from {MIN_GIB:g}, one byte, to {MAX_GIB:g}"


def is_gib(value: Any) -> bool:
    """Whether ``value`` is a memory budget in GiB: a finite real number from :data:`MIN_GIB` to
    :data:`MAX_GIB` (not a bool)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, numbers.Real)
        and math.isfinite(value)
        and MIN_GIB <= value <= MAX_GIB
    )


def _positive_int(config: Any, name: str, *, optional: bool) -> None:
    """Check an integer field and store it as a plain int (numpy / torch integers accepted)."""
    value = getattr(config, name)
    if optional and value is None:
        return
    object.__setattr__(config, name, check_int(name, value, 1, "give a whole number >= 1."))


class _ConfigMethods:
    """The checks and derived values of :class:`DynBatchConfig` (its fields come from the table)."""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_CHOICES:
            raise DynBatchValueError(
                f"attention={self.attention!r} ({FLAGS['attention']}) is not one of "
                f"{', '.join(ATTENTION_CHOICES)}; pick one (auto picks for this machine)."
            )
        if self.max_tokens_per_gpu is None:
            raise DynBatchValueError(
                "max_tokens_per_gpu is not set; pass --max-tokens-per-gpu (or set "
                "max_tokens_per_gpu in the --dynamic-batch-config YAML) with the token budget of "
                "one micro-batch on one GPU, or a memory budget (--max-memory-gib) where the "
                "host derives the token budget from it."
            )
        memory = self.max_memory_gib
        if memory is not None and memory != "auto":
            if not is_gib(memory):
                raise DynBatchValueError(
                    f"max_memory_gib={memory!r} must be a number of GiB > 0 ({GIB_RANGE}) or "
                    f"'auto'; fix "
                    f"{FLAGS['max_memory_gib']}."
                )
            object.__setattr__(self, "max_memory_gib", float(memory))
        # Every other field is checked once, by the planner's own configs (one wording in every
        # host), which name the setting; setting_flags adds the flag that sets it here.
        with setting_flags(_SETTING_FLAGS):
            _positive_int(self, "log_probs_max_tokens_per_gpu", optional=True)
            cost = self.cost_model()  # as set (the planner's copy fills in an assumed overhead)
            planner = self._planner_config(ParallelLayout(), self.max_tokens_per_gpu)
        _check_planner(self.planner)
        # The checked values as the planner normalised them (numpy integers, YAML's ``1`` for a
        # float), so equal configs compare equal.
        object.__setattr__(self, "max_tokens_per_gpu", planner.max_tokens_per_gpu)
        object.__setattr__(self, "rollouts_per_step", planner.rollouts_per_step)
        if self.min_gain is not None:
            object.__setattr__(self, "min_gain", planner.min_gain)
        for name in _COST_FIELDS:
            value = getattr(cost, _PLANNER_NAMES[name])
            object.__setattr__(self, name, None if value is None else float(value))

    @property
    def forward_only_max_tokens_per_gpu(self) -> int:
        """Budget of forward-only passes: ``log_probs_max_tokens_per_gpu`` or the training one."""
        return self.log_probs_max_tokens_per_gpu or self.max_tokens_per_gpu

    def truncation(
        self, parallel: ParallelLayout, longest: int, *, forward_only: bool = False
    ) -> Optional[Tuple[int, str]]:
        """``(tokens, flag)``: what ``oversize_samples='truncate'`` cuts a sample to, where that
        is shorter than ``longest`` (the longest sample the host can have, e.g. ``--seq-length``),
        and the budget flag that sets it; ``None`` under another policy or where nothing is cut.

        The planner's own rule (:func:`~megatron_dynbatch.planning.planner._apply_oversize_policy`):
        the budget times cp, rounded down to the sample multiple. A memory budget's smaller cap
        is not known before the model is measured, so it is not counted here. Every start-up
        message and check that names the cut reads it here, from the resolved settings (flags
        over the YAML), so none of them misses a policy or budget set in the YAML alone.
        """
        if self.oversize_samples != "truncate":
            return None
        if forward_only:
            budget = self.forward_only_max_tokens_per_gpu
            flag = FLAGS["log_probs_max_tokens_per_gpu"]
            if self.log_probs_max_tokens_per_gpu is None:
                flag = f"{flag}, default {FLAGS['max_tokens_per_gpu']}"
        else:
            budget, flag = self.max_tokens_per_gpu, FLAGS["max_tokens_per_gpu"]
        multiple = parallel.sample_multiple
        kept = budget * parallel.cp_size // multiple * multiple
        return (kept, flag) if 0 < kept < longest else None

    def cost_model(self) -> CostModel:
        return CostModel(
            **{check: getattr(self, name) for name, check in _COST_MODEL_FIELDS.items()}
        )

    def planner_config(
        self,
        parallel: ParallelLayout,
        *,
        forward_only: bool = False,
        row_multiple: Optional[int] = None,
        memory: Optional[Any] = None,
    ) -> PlannerConfig:
        """The pure planner's config for a parallel layout.

        Forward-only passes use the log-prob budget and plan the whole batch as one pass
        (``rollouts_per_step`` only splits optimizer steps). ``row_multiple``: the host exchanges
        shapes per micro-batch (slime; Megatron-LM with ``--variable-seq-lengths``), so every
        micro-batch runs its own row, rounded up to this multiple; ``None``: uniform rows.
        ``memory``: the :class:`~megatron_dynbatch.planning.memory.MemoryLimit` of
        ``max_memory_gib`` (built by the host, which knows the model), or ``None``.

        Raises:
            ValueError: When the budget cannot hold one padded sample of the layout, naming the
                flag to raise.
        """
        if forward_only:
            budget_flag = FLAGS["log_probs_max_tokens_per_gpu"]
            budget = self.forward_only_max_tokens_per_gpu
        else:
            budget_flag, budget = FLAGS["max_tokens_per_gpu"], self.max_tokens_per_gpu
        try:
            return self._planner_config(
                parallel,
                budget,
                forward_only=forward_only,
                row_multiple=row_multiple,
                memory=memory,
                budget_flag=budget_flag,
            )
        except ValueError as error:
            # Name the budget (training or log-prob) only where the error is about it: a memory
            # budget that holds no micro-batch is --max-memory-gib's, whichever budget was built.
            if "max_tokens_per_gpu" not in str(error):
                raise
            raise DynBatchValueError(f"{budget_flag}: {error}") from error

    def _planner_config(
        self,
        parallel: ParallelLayout,
        budget: int,
        *,
        forward_only: bool = False,
        row_multiple: Optional[int] = None,
        memory: Optional[Any] = None,
        budget_flag: str = FLAGS["max_tokens_per_gpu"],
    ) -> PlannerConfig:
        """The one ``PlannerConfig`` of these settings (:meth:`planner_config`; unwrapped errors
        for ``__post_init__``, which names the flags itself)."""
        return PlannerConfig(
            max_tokens_per_gpu=budget,
            parallel=parallel,
            rollouts_per_step=None if forward_only else self.rollouts_per_step,
            layout=self.layout,
            cost=self.cost_model(),
            oversize_samples=self.oversize_samples,
            min_gain=self.min_gain,
            variable_row_lengths=row_multiple is not None,
            row_multiple=1 if row_multiple is None else row_multiple,
            memory=memory,
            planner=self.planner,
            budget_flag=budget_flag,
        )


def _check_planner(name: str) -> None:
    """Refuse a planner name nothing registered, at start-up rather than at the first step."""
    # Imported here: the registry imports the whole planner, which the config otherwise needs
    # only the specs of.
    from megatron_dynbatch.planning.registry import get_planner

    try:
        get_planner(name)
    except DynBatchValueError as error:
        raise DynBatchValueError(f"planner={name!r} ({FLAGS['planner']}): {error}") from None


def _config_class() -> type:
    """:class:`DynBatchConfig`: a frozen, keyword-only dataclass with one field per config setting
    of :data:`megatron_dynbatch.settings.SETTINGS`, documented from its row."""
    fields = []
    for row in _SETTINGS:
        spec = {} if row.default is REQUIRED else {"default": row.default}
        fields.append((row.name, row.annotation, dataclasses.field(**spec, metadata={"row": row})))
    attributes = "\n".join(
        f"    {row.name} ({row.flag}): {row.doc}"
        + (" Required." if row.default is REQUIRED else "")
        for row in _SETTINGS
    )
    cls = dataclasses.make_dataclass(
        "DynBatchConfig", fields, bases=(_ConfigMethods,), frozen=True, kw_only=True
    )
    cls.__module__ = __name__
    cls.__doc__ = (
        "What ``--use-dynamic-batch-size`` training plans with: one field per config setting of "
        "megatron_dynbatch/settings.py (its YAML key; its flag in ``FLAGS``).\n\nAttributes:\n"
        + attributes
    )
    return cls


DynBatchConfig = _config_class()

_FIELDS = tuple(f.name for f in dataclasses.fields(DynBatchConfig))
assert set(_FIELDS) == set(FLAGS), "every config field needs a flag"


def config_from_mapping(
    values: Mapping[str, Any],
    *,
    table: Optional[Mapping[str, str]] = None,
    fixed: Optional[Mapping[str, Any]] = None,
    host: str = "the dynamic-batch config",
) -> DynBatchConfig:
    """Build a :class:`DynBatchConfig`: the one function that constructs it outside tests.

    Every host maps its own option names to the config's fields in a table and calls this; a
    value of ``None`` means "not set" (the field's default applies).

    Args:
        values: The settings, by field name (``table=None``: the YAML, Megatron's flags, the CLI)
            or by the host's own option names (``table`` given).
        table: The host's option name -> :class:`DynBatchConfig` field, e.g. SkyRL's
            ``{"max_tokens_per_microbatch": "max_tokens_per_gpu"}``.
        fixed: Fields the host decides itself, by field name (e.g. ``layout="packed"`` for a
            trainer that always packs); they must not also come from ``values``.
        host: How error messages name where the values came from.

    Raises:
        ValueError: On an unknown key (naming the valid ones) or a bad value (naming, with a
            table, the host's option that set it).
    """
    if table is None:
        unknown = sorted(set(values) - set(_FIELDS))
        if unknown:
            raise DynBatchValueError(
                f"unknown dynamic-batch config key(s) {unknown}; valid keys are {list(_FIELDS)}."
            )
        fields = dict(values)
    else:
        assert set(table.values()) <= set(_FIELDS), f"{host}: table names unknown fields"
        unknown = sorted(set(values) - set(table))
        if unknown:
            raise DynBatchValueError(
                f"{host}: unknown option(s) {unknown}; valid: {sorted(table)}."
            )
        fields = {table[name]: value for name, value in values.items()}
    fixed = dict(fixed or {})
    assert not set(fixed) & set(fields), f"{host}: fixed fields also given as options"
    assert set(fixed) <= set(_FIELDS), f"{host}: fixed names unknown fields"
    kwargs = {key: value for key, value in {**fields, **fixed}.items() if value is not None}
    # A missing budget is reported by __post_init__ (naming the flag), not as a TypeError.
    kwargs.setdefault("max_tokens_per_gpu", None)
    try:
        return DynBatchConfig(**kwargs)
    except ValueError as error:
        if table is None:
            raise
        spelled = ", ".join(f"{name} -> {field}" for name, field in sorted(table.items()))
        raise type(error)(f"{error} (in {host}: {spelled})") from error


#: YAML 1.2 floats without a dot (``4e-5``), which PyYAML's YAML 1.1 resolver reads as strings.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


def _strict_loader():
    """A ``yaml.SafeLoader`` that reads ``4e-5`` as a float and refuses duplicate keys.

    A duplicate key in a config is a mistake whichever value wins (PyYAML keeps the last one
    silently).
    """
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found duplicate key {key!r}; give every key once",
                        key_node.start_mark,
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    StrictLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789")
    )
    return StrictLoader


def load_yaml_config(
    path: Union[str, os.PathLike], *, overridden: Iterable[str] = ()
) -> Dict[str, Any]:
    """Read a ``--dynamic-batch-config`` YAML file into a dict of field values.

    Keys are :class:`DynBatchConfig` field names; a ``null`` value means "not set here" (the flag or
    the dataclass default applies). Every value is checked here, so a bad value fails before any
    flag is merged in, naming the file and the key. ``overridden``: the keys the command line
    sets, which are neither checked nor returned (issue 44: a YAML ``max_tokens_per_gpu: lots``
    was refused although ``--max-tokens-per-gpu 1024`` replaced it).

    Raises:
        ValueError: On a missing file, invalid or too deeply nested YAML, YAML that is not a
            mapping, a duplicate key, or an unknown key (with the list of valid keys), so a typo
            never silently falls back to a default.
    """
    import yaml  # Only the loader needs PyYAML.

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DynBatchValueError(
            f"--dynamic-batch-config {path!r} does not exist or is not a file."
        )
    with open(path, encoding="utf-8") as handle:
        try:
            data = yaml.load(handle, Loader=_strict_loader())  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as error:
            raise DynBatchValueError(
                f"--dynamic-batch-config {path!r} is not valid YAML: {error}"
            ) from error
        except RecursionError:
            raise DynBatchValueError(
                f"--dynamic-batch-config {path!r} is nested too deeply to be a config; it must be "
                "a flat mapping of key: value."
            ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DynBatchValueError(
            f"--dynamic-batch-config {path!r} must hold a mapping of key: value, got "
            f"{type(data).__name__}."
        )
    unknown = sorted(str(key) for key in set(data) - set(_FIELDS))
    if unknown:
        raise DynBatchValueError(
            f"--dynamic-batch-config {path!r}: unknown key(s) {unknown}; valid keys are "
            f"{list(_FIELDS)}."
        )
    data = {key: value for key, value in data.items() if key not in set(overridden)}
    # The budget may come from --max-tokens-per-gpu instead; 1 stands in for it while the other
    # values are checked. One key at a time first, so an error names the key it is about.
    stand_in = {"max_tokens_per_gpu": 1}
    for key, value in data.items():
        try:
            config_from_mapping({**stand_in, key: value} if value is not None else stand_in)
        except ValueError as error:
            raise DynBatchValueError(
                f"--dynamic-batch-config {path!r}, key {key}: {value!r} is refused: {error} "
                f"Fix {key} in that file, or give {FLAGS[key]} on the command line (it "
                "overrides the file)."
            ) from None
    try:
        config_from_mapping({**stand_in, **{k: v for k, v in data.items() if v is not None}})
    except ValueError as error:
        raise DynBatchValueError(
            f"--dynamic-batch-config {path!r}: its keys {sorted(data)} do not go together: {error}"
        ) from None
    return dict(data)
