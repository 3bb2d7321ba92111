"""Every dynamic-batching setting, one row each: the table the flags, the config and the YAML come from.

Each :class:`Setting` row holds a setting's name (the :class:`~megatron_dynbatch.config.DynBatchConfig`
field and the ``--dynamic-batch-config`` YAML key), its type and default, who checks it, its
documentation, its Megatron-LM training flag with ``--help`` text, and whether ``megatron-dynbatch
plan`` / ``verify`` take it. From :data:`SETTINGS` are built:

* the config dataclass's fields, their documentation and ``FLAGS`` (``config.py``);
* the YAML reader's valid keys and ``configs/dynbatch.yaml`` itself (:func:`reference_yaml`;
  ``python -m megatron_dynbatch.settings > configs/dynbatch.yaml`` rewrites it, a test compares);
* the Megatron-LM argument group (:func:`add_training_args`, used by
  ``integrations/megatron_lm/arguments.py``);
* the settings flags of ``megatron-dynbatch plan`` and ``verify`` (:func:`add_cli_args`, used by
  ``tools/cli.py``).

One spelling per setting: the training flag (``--dynamic-batch-layout``) is also the command's.
The command's older spellings (``--layout``, ``--cost-*``, ``--min-gain``, ``--planner``) stay as
hidden aliases (:attr:`Cli.aliases`), so existing command lines keep working; a command line that
uses one gets its messages in those spellings.

Each host names the settings in its own keys: its record in ``integrations/hosts.py`` (the rows
beside this table) maps its option names to the names here, and checks that every name it uses is
a row of this table. Megatron-LM's record is this table's flags.

Adding a setting
----------------
Add one :class:`Setting` row to :data:`SETTINGS`:

* a config setting (a YAML key): ``name``, ``annotation``, ``default`` (``REQUIRED`` for none),
  ``doc`` (what it means; it becomes the dataclass field's documentation and the YAML comment),
  ``flag`` and ``help`` (the training flag), ``parse`` / ``choices`` (how argparse reads it), and
  ``check``: the name the planner's own checks give it (``PlannerConfig`` / ``CostModel``), or
  ``None`` where ``DynBatchConfig.__post_init__`` checks it;
* a flag of the launch only (no YAML key, not in the config): ``name=None`` and ``dest`` (where
  argparse stores it), with ``action`` / ``parse`` / ``default`` as argparse takes them;
* ``cli=Cli(...)`` where ``plan`` / ``verify`` take it too (``help`` / ``default`` there when they
  differ, e.g. ``plan`` reports oversize samples rather than refusing them).

Then rewrite ``configs/dynbatch.yaml`` (above) and, for a config setting, pass it on where the
planner or the run reads it (``DynBatchConfig.planner_config`` or the hooks). Nothing else lists
the settings: the tests build every parser from this table and compare.

Standard library and the pure planner's names only (no torch, no megatron).
"""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

from megatron_dynbatch.planning.spec import (
    ATTENTION_KINDS,
    DEFAULT_PLANNER,
    LAYOUTS,
    OVERSIZE_POLICIES,
)

__all__ = [
    "ATTENTION_CHOICES",
    "OLD_SPELLINGS_DEST",
    "REQUIRED",
    "SETTINGS",
    "Cli",
    "Setting",
    "add_cli_args",
    "add_training_args",
    "cli_settings",
    "config_settings",
    "memory_gib",
    "reference_yaml",
    "setting",
]


class _Required:
    """The default of a setting that has none (the config refuses to be built without it)."""

    def __repr__(self) -> str:
        return "REQUIRED"


#: ``Setting.default`` of a config setting that must be given (``max_tokens_per_gpu``).
REQUIRED: Any = _Required()

#: Where ``--variable-seq-lengths`` is stored in training: Megatron-LM's ``validate_args`` resets
#: its own ``args.variable_seq_lengths`` (it has no flag for it), so the request keeps a name of ours.
VARIABLE_SEQ_LENGTHS_DEST = "dynamic_batch_variable_seq_lengths"

#: The core attention a Megatron-LM launch runs (``--dynamic-batch-attention``, YAML
#: ``attention``): ``auto`` picks one (``integrations/megatron_lm/attention.py``);
#: ``transformer-engine``: Megatron's TE spec as is; ``torch-varlen``: torch's flash kernels
#: (``mcore/varlen_attention.py``, CUDA); ``reference``: the torch reference of TE's THD attention
#: (``mcore/thd_attention.py``, any device, dense).
ATTENTION_CHOICES = ("auto", "transformer-engine", "torch-varlen", "reference")

#: Measured iterations in-run calibration fits by default (``--dynamic-batch-calibration-steps``).
DEFAULT_CALIBRATION_STEPS = 8
#: A fit whose median relative error over the measured steps exceeds this is not planned with
#: (``--dynamic-batch-calibration-max-error``): fits of 30-35% planned rows 1.5-3x slower than the
#: others on this CPU machine (issue 37), while fits on quiet steps land at 2-15%.
DEFAULT_CALIBRATION_MAX_ERROR = 0.2
#: Files calibration writes (``--dynamic-batch-calibration-output``).
CALIBRATION_YAML = "dynbatch_calibration.yaml"
CALIBRATION_JSON = "dynbatch_calibration.json"


def memory_gib(text: str) -> Any:
    """``--max-memory-gib``'s value: a number of GiB, or ``auto``."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB or 'auto'") from None


@dataclass(frozen=True, kw_only=True)
class Cli:
    """How ``megatron-dynbatch plan`` / ``verify`` take a setting (under its training flag)."""

    commands: Tuple[str, ...] = ("plan", "verify")
    """The subcommands that take it."""
    aliases: Tuple[str, ...] = ()
    """Older spellings the commands still accept, hidden from ``--help``; messages use the first
    where a command line used any of them."""
    help: Optional[str] = None
    """``--help`` text; ``None``: the training flag's."""
    default: Any = None
    """The command's default, by command name where they differ (``{"verify": 128}``); the
    config's default applies to ``None``."""
    required: Tuple[str, ...] = ()
    """The subcommands that require it."""
    parse: Optional[Callable[[str], Any]] = None
    """argparse's ``type`` there; ``None``: the training flag's."""
    dest: Optional[str] = None
    """argparse's destination there; ``None``: the setting's name (or the training ``dest``)."""

    def default_for(self, command: str) -> Any:
        if isinstance(self.default, Mapping):
            return self.default.get(command)
        return self.default


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One setting: its config field and YAML key, its flag and its checks (one row)."""

    flag: str
    """The Megatron-LM training flag, also ``plan`` / ``verify``'s (one spelling)."""
    help: str
    """The training flag's ``--help`` text (argparse format: ``%%`` for a percent sign)."""
    name: Optional[str] = None
    """The :class:`~megatron_dynbatch.config.DynBatchConfig` field and YAML key; ``None``: a flag
    of the launch only, not a config setting."""
    annotation: Any = None
    """The config field's type (a config setting only)."""
    default: Any = None
    """The config field's default (``REQUIRED``: none), or a launch flag's argparse default.
    Config settings' flags default to ``None`` so a flag given can be told from one left out."""
    doc: str = ""
    """What a config setting means and does: the dataclass field's documentation and the comment
    above its key in ``configs/dynbatch.yaml``."""
    yaml_heading: str = ""
    """A comment opening a group of keys in ``configs/dynbatch.yaml`` (above this one's)."""
    check: Optional[str] = None
    """How the planner's checks (``PlannerConfig``, ``CostModel``) name the setting: they check
    its value once, and messages add this row's flag; ``None``: ``DynBatchConfig`` checks it."""
    parse: Optional[Callable[[str], Any]] = None
    """argparse's ``type`` (``int``, ``float``, :func:`memory_gib`)."""
    choices: Optional[Tuple[str, ...]] = None
    metavar: Optional[str] = None
    action: Any = None
    """argparse's ``action`` (``store_true``, ``argparse.BooleanOptionalAction``)."""
    dest: Optional[str] = None
    """argparse's destination; ``None``: the flag without dashes (Megatron-style)."""
    cli: Optional[Cli] = None
    """How ``plan`` / ``verify`` take it; ``None``: training only."""
    derived_when_unset: bool = False
    """The Megatron-LM entry derives it from the run when it is not set (the attention weight
    from the model; the layout, padded under ``seq_aux_loss``): ``configs/dynbatch.yaml`` leaves
    it ``null``, since a file passed with ``--dynamic-batch-config`` that wrote the default would
    switch that off (a probe: the shipped file was refused with ``seq_aux_loss``)."""

    def __post_init__(self) -> None:
        assert self.flag.startswith("--"), self.flag
        if self.name is not None:
            assert self.doc and self.annotation is not None, f"{self.name}: document and type it"

    @property
    def training_dest(self) -> str:
        return self.dest or self.flag[2:].replace("-", "_")

    @property
    def cli_dest(self) -> str:
        assert self.cli is not None
        return self.cli.dest or self.name or self.training_dest

    def argparse_kwargs(self, command: Optional[str] = None) -> Dict[str, Any]:
        """``add_argument``'s keywords for training (``command=None``) or a subcommand."""
        action = self.action
        kwargs: Dict[str, Any] = {"help": self.help}
        if command is None:
            kwargs["dest"] = self.training_dest
            # Config settings: None tells a flag left out from one given (which overrides YAML).
            kwargs["default"] = None if self.name is not None else self.default
            parse = self.parse
        else:
            assert self.cli is not None and command in self.cli.commands, (self.flag, command)
            kwargs["dest"] = self.cli_dest
            kwargs["default"] = self.cli.default_for(command)
            if self.cli.help is not None:
                kwargs["help"] = self.cli.help
            if isinstance(self.cli.default, Mapping) and kwargs["default"] is not None:
                kwargs["help"] += f" (default {kwargs['default']})"
            if command in self.cli.required:
                kwargs["required"] = True
            parse = self.cli.parse or self.parse
        if action is not None:
            kwargs["action"] = action
        if parse is not None:
            kwargs["type"] = parse
        if self.choices is not None:
            kwargs["choices"] = self.choices
        if self.metavar is not None:
            kwargs["metavar"] = self.metavar
        return kwargs


def _cost_weight(name: str, what: str, default: float, doc: str, **extra: Any) -> Setting:
    """A cost-model weight: a float >= 0 the planner's ``CostModel`` checks."""
    return Setting(
        name=name,
        flag="--dynamic-batch-" + name.replace("_", "-"),
        annotation=extra.pop("annotation", float),
        default=default,
        check=name[len("cost_") :],
        parse=float,
        help=f"Planner cost-model weight of {what}.",
        doc=doc,
        **extra,
    )


#: Every setting, one row each (config settings first, in the dataclass's field order).
SETTINGS: Tuple[Setting, ...] = (
    Setting(
        name="max_tokens_per_gpu",
        flag="--max-tokens-per-gpu",
        annotation=int,
        default=REQUIRED,
        check="max_tokens_per_gpu",
        parse=int,
        help="Token budget of one training micro-batch on one GPU, padding included.",
        doc="Token budget of one training micro-batch on one GPU, padding included. Required: set "
        "it here or on the command line. With context parallelism a micro-batch holds cp_size "
        "times this many tokens, split over the CP ranks.",
        cli=Cli(
            help="hard token cap of one micro-batch on one GPU (plan: required unless "
            "--max-memory-gib gives the budget, as in training)",
            default={"verify": 128},
        ),
    ),
    Setting(
        name="log_probs_max_tokens_per_gpu",
        flag="--log-probs-max-tokens-per-gpu",
        annotation=Optional[int],
        default=None,
        check="log_probs_max_tokens_per_gpu",
        parse=int,
        help="Token budget of one forward-only (log-prob) micro-batch; default: "
        "--max-tokens-per-gpu.",
        doc="Budget of one forward-only (log-prob) micro-batch. No activations are kept for a "
        "backward pass, so it can be larger than max_tokens_per_gpu. null: max_tokens_per_gpu.",
    ),
    Setting(
        name="layout",
        flag="--dynamic-batch-layout",
        annotation=str,
        default="packed",
        check="layout",
        choices=LAYOUTS,
        derived_when_unset=True,
        help="packed: one row of concatenated samples per micro-batch; padded: [B, S] rows. "
        "Default: packed.",
        doc="packed: samples concatenated in one row per micro-batch (segment-aware attention / "
        "THD cu_seqlens); padded: [B, S] rows, one sample per row.",
        cli=Cli(
            aliases=("--layout",),
            help="packed (samples share a row) or padded (one sample a row); default packed",
            default="packed",
        ),
    ),
    Setting(
        name="rollouts_per_step",
        flag="--rollouts-per-step",
        annotation=Optional[int],
        default=None,
        check="rollouts_per_step",
        parse=int,
        help="Rollouts (prompt groups) per optimizer step; default: one step per batch the "
        "iterator yields. In Megatron-LM's training loop it must equal --global-batch-size, "
        "which then counts rollouts instead of samples.",
        doc="Rollouts (prompt groups / trajectories) per optimizer step. The training data "
        "iterator may yield several steps' worth at once; null: every batch it yields is one "
        "step.",
        cli=Cli(
            commands=("plan", "verify"),
            help="rollouts (prompt groups) per optimizer step (default: all in one step)",
        ),
    ),
    _cost_weight(
        "cost_token_weight",
        "the sample length L (default 1.0)",
        1.0,
        "Weight of one position's linear work (MLP and projections).",
        yaml_heading="Cost model of one micro-batch [B, S], whose step time the planner minimises: "
        "token_weight * B * S (every position, padding included) + attention_weight * the "
        "attention term (by cost_attention) + response_weight * response tokens + "
        "microbatch_overhead.",
        cli=Cli(help="weight of a position's linear work (default 1.0)"),
    ),
    _cost_weight(
        "cost_attention_weight",
        "L**2, the attention term (default: the model's own, from its dimensions and the "
        "attention in use; 0.0 without them)",
        0.0,
        "Weight of the attention term, per causal square L**2; about 1/(6*hidden_size) of the "
        "token weight. Long-context runs set it > 0; the Megatron-LM entry derives it from the "
        "model's dimensions and the attention in use when it is not set (docs/cost-model.md).",
        derived_when_unset=True,
        cli=Cli(
            aliases=("--cost-attention-weight",),
            help="weight of a segment's squared length (attention), per unit of a token's linear "
            "work (default: the model's FLOPs ratio where plan is given the model flags, else 0)",
        ),
    ),
    _cost_weight(
        "cost_response_weight",
        "the response length (default 0.0)",
        0.0,
        "Weight of the response length (work done on generated tokens only).",
        cli=Cli(aliases=("--cost-response-weight",), help="weight of response tokens"),
    ),
    _cost_weight(
        "cost_microbatch_overhead",
        "one micro-batch, its fixed cost (default: estimated from the model's layers per stage "
        "and the device; without the model's dimensions unknown, 2%% of a full row assumed)",
        None,
        "Fixed cost of one micro-batch (launches, pipeline send/receive, Python) in units of one "
        "token's linear work, e.g. from megatron-dynbatch calibrate. null: in the Megatron-LM "
        "entry, estimated from the model's layers per stage and the device (more micro-batches "
        "then need a 10% gain until calibration measures it); elsewhere unknown: the planner "
        "assumes 2% of a full row at the budget and asks more micro-batches for a 3% gain.",
        annotation=Optional[float],
        cli=Cli(
            aliases=("--cost-microbatch-overhead",),
            help="fixed cost of one micro-batch, in tokens of linear work (default: unknown; 2%% "
            "of a full row at the cap is assumed and more micro-batches need a 3%% predicted "
            "gain)",
        ),
    ),
    _cost_weight(
        "cost_shape_exchange_overhead",
        "one micro-batch's shape exchange when row lengths vary (default 0.0)",
        0.0,
        "Extra fixed cost of one micro-batch when its step's rows vary in length: the shape "
        "exchange of Megatron's variable_seq_lengths, in units of one token's linear work.",
        cli=Cli(
            aliases=("--cost-shape-exchange-overhead",),
            help="extra fixed cost of a micro-batch whose step's rows vary in length (default 0)",
        ),
    ),
    Setting(
        name="cost_attention",
        flag="--dynamic-batch-cost-attention",
        annotation=Optional[str],
        default=None,
        check="attention",
        choices=ATTENTION_KINDS,
        help="What the attention runs, for the cost model: segment (THD / flash varlen), causal "
        "(one causal row), dense (masked S x S, --transformer-impl local). Default: from "
        "--transformer-impl and --attention-backend.",
        doc="What the attention implementation executes: segment (THD / flash varlen: the sum of "
        "each sample's squared length), causal (each row one causal sequence: S**2), dense (a "
        "masked S x S softmax, Megatron's local implementation: 2 * S**2). null: from "
        "--transformer-impl / --attention-backend in Megatron-LM (local or unfused: dense; "
        "otherwise segment packed, causal padded), else segment packed and causal padded.",
        cli=Cli(
            aliases=("--cost-attention",),
            help="what the attention runs: segment (THD / flash varlen), causal (one causal row), "
            "dense (masked S x S, Megatron's local); default: segment packed, causal padded",
        ),
    ),
    Setting(
        name="min_gain",
        flag="--dynamic-batch-min-gain",
        annotation=Optional[float],
        default=None,
        check="min_gain",
        parse=float,
        help="Relative predicted gain more micro-batches per rank must promise to be planned "
        "(default 0.03 with an unknown micro-batch overhead, 0.10 with the Megatron-LM entry's "
        "estimated one until a calibration fit, 0 with a given one).",
        doc="Relative predicted step-time gain more micro-batches per rank must promise to be "
        "planned. null: 0.03 while the micro-batch overhead is unknown, 0.10 while it is the "
        "Megatron-LM entry's estimate (before a calibration fit), 0 once it is given "
        "(calibrated).",
        cli=Cli(
            aliases=("--min-gain",),
            help="relative predicted gain more micro-batches per rank must promise (default 0.03 "
            "with an unknown overhead, 0 with --dynamic-batch-cost-microbatch-overhead)",
        ),
    ),
    Setting(
        name="oversize_samples",
        flag="--oversize-samples",
        annotation=str,
        default="error",
        check="oversize_samples",
        choices=OVERSIZE_POLICIES,
        help="A sample longer than the budget: error (default) refuses the batch, truncate cuts "
        "it to the budget, allow runs it alone over the budget.",
        doc="A sample longer than max_tokens_per_gpu: error refuses the batch before any model "
        "work, naming the samples; truncate cuts it to the budget (the cut tokens are not "
        "trained, and are counted); allow runs it alone in its micro-batch, over the budget "
        "(every micro-batch of its step then gets its length: more memory on every GPU).",
        cli=Cli(
            default="allow",
            help="a sample longer than the cap: allow (default: alone, over the cap, warned), "
            "truncate (cut to the cap), error. The default differs from training's (error, in "
            "launch/pretrain_gpt_dynbatch.py) on purpose: this command only reports what a plan "
            "would do, oversize samples listed, while a training run would spend their memory",
        ),
    ),
    Setting(
        name="max_memory_gib",
        flag="--max-memory-gib",
        annotation=Optional[Union[float, str]],
        default=None,
        parse=memory_gib,
        help="The most one GPU (on CPU: one rank's process) may hold at its peak in a training "
        "step, in GiB, or 'auto' (the device's memory less 10%%). The planner keeps every "
        "pipeline stage's predicted peak within it; with it alone the token budget is what it "
        "allows. See docs/memory.md.",
        doc="The most one GPU (on CPU: one rank's process) may hold at its peak in a training "
        "step, in GiB; auto: the device's memory less a margin (docs/memory.md). The planner "
        "keeps every pipeline stage's predicted peak within it, beside max_tokens_per_gpu (with "
        "only this given, the Megatron-LM entry derives the token budget from it). null: the "
        "token budget alone.",
        cli=Cli(
            commands=("plan",),
            parse=float,
            help="memory budget of one GPU in GiB: no planned step's predicted peak exceeds it "
            "(the model's bytes only: add the CUDA context / process to your margin; needs the "
            "model flags)",
        ),
    ),
    Setting(
        name="planner",
        flag="--dynamic-batch-planner",
        annotation=str,
        default=DEFAULT_PLANNER,
        check="planner",
        parse=str,
        metavar="NAME",
        help="The planner that plans every step, by registered name: dynbatch (default, this "
        "package's), dynbatch-thorough (the same, spending several times the planning CPU "
        "under a pipeline for a step simulated about 1% faster), fixed (Megatron's padded batching under the same budget; needs "
        "--dynamic-batch-layout padded), or module:name for one a module registers when "
        "imported.",
        doc="The planner that plans every step, by registered name: dynbatch (this package's), "
        "dynbatch-thorough (the same, spending several times the planning CPU under a "
        "pipeline for a step simulated about 1% faster: for long steps), fixed (Megatron's stock padded batching under the same budget; needs layout: padded), "
        "or module:name for one a module registers when imported (e.g. "
        "benchmarks.baselines:verl_kk from a checkout). An unknown name fails at start-up.",
        cli=Cli(
            commands=("plan", "verify"),
            aliases=("--planner",),
            default=DEFAULT_PLANNER,
            help=f"planner (default {DEFAULT_PLANNER}; built in: dynbatch, dynbatch-thorough, "
            "fixed; MODULE:NAME "
            "imports MODULE first, e.g. benchmarks.baselines:verl_kk from a checkout)",
        ),
    ),
    Setting(
        name="attention",
        flag="--dynamic-batch-attention",
        annotation=str,
        default="auto",
        choices=ATTENTION_CHOICES,
        help="The core attention, in every mode of the launch (stock and fixed too): "
        "transformer-engine (--transformer-impl transformer_engine), torch-varlen (torch's "
        "flash kernels: varlen on packed THD rows, SDPA flash on the others; CUDA, bf16/fp16, "
        "--transformer-impl local), reference (a dense torch reference of TE's THD attention, "
        "any device). Default auto: transformer-engine with --transformer-impl "
        "transformer_engine, else torch-varlen on CUDA in bf16/fp16, else Megatron's local "
        "attention with the reference where rows are THD. One that cannot run is refused.",
        doc="The core attention of the Megatron-LM launch (--dynamic-batch-attention, which also "
        "works without dynamic batching): auto (transformer-engine with --transformer-impl "
        "transformer_engine; else torch-varlen on CUDA in bf16/fp16; else Megatron's local "
        "attention, with the reference where rows are THD), transformer-engine, torch-varlen "
        "(torch's flash kernels: varlen on packed THD rows, SDPA flash on the others; CUDA, "
        "bf16/fp16) or reference (a dense torch reference of transformer-engine's THD attention, "
        "any device). One that cannot run is refused at start-up.",
    ),
    # -- flags of the Megatron-LM launch only (not config settings, no YAML key) ----------------
    Setting(
        flag="--use-dynamic-batch-size",
        action="store_true",
        default=False,
        help="Plan every step's micro-batches under a token budget (needs the megatron_dynbatch "
        "patches); the training iterator then yields rollout batches.",
    ),
    Setting(
        flag="--variable-seq-lengths",
        dest=VARIABLE_SEQ_LENGTHS_DEST,
        action=argparse.BooleanOptionalAction,
        help="Each micro-batch runs its own row length (its samples rounded up to 64 tokens) "
        "instead of the step's longest; megatron.core then exchanges every micro-batch's shape "
        "before its pipeline send (variable_seq_lengths). Default: on where the exchange costs "
        "microseconds (NCCL, CUDA), with uniform rows kept where the cost model says they win; "
        "off on gloo (CPU), where it costs about a millisecond a micro-batch.",
        cli=Cli(
            commands=("plan",),
            dest="variable_seq_lengths",
            help="every micro-batch its own row, rounded up to 64 tokens, as the Megatron-LM "
            "entry runs on NCCL (default: on with the model flags, which plan what the entry "
            "runs on a GPU; off without them)",
        ),
    ),
    Setting(
        flag="--dynamic-batch-plan-ahead",
        action=argparse.BooleanOptionalAction,
        help="Read the next training batch as soon as a step is prepared and plan it in a "
        "background thread while the step trains; the next step uses that plan when it plans "
        "with the same settings (calibration and the memory model may change them), else plans "
        "again. The plans are the same either way. Default: on for the launch script's own data "
        "(documents, blends, conversations); off for a host's own iterator, whose next batch may "
        "come from the model the step trains.",
    ),
    Setting(
        flag="--dynamic-batch-config",
        parse=str,
        help="YAML file of dynamic-batching settings (keys: see configs/dynbatch.yaml); flags "
        "given on the command line override it.",
    ),
    Setting(
        flag="--dynamic-batch-reference-thd-attention",
        action="store_true",
        default=False,
        help="Deprecated: the same as --dynamic-batch-attention reference.",
    ),
    Setting(
        flag="--dynamic-batch-calibration-steps",
        parse=int,
        default=DEFAULT_CALIBRATION_STEPS,
        help="Fit the planner's cost model to this many measured training iterations, then plan "
        f"with it (default {DEFAULT_CALIBRATION_STEPS}; 0 keeps the configured weights).",
    ),
    Setting(
        flag="--dynamic-batch-calibration-max-error",
        parse=float,
        default=DEFAULT_CALIBRATION_MAX_ERROR,
        help="Plan with a fit only when its median relative error over the measured steps is at "
        f"most this (default {DEFAULT_CALIBRATION_MAX_ERROR}); over it, as many steps again are "
        "measured and refit, then a fit still over it is not used (the log says so).",
    ),
    Setting(
        flag="--dynamic-batch-recalibrate",
        action="store_true",
        default=False,
        help=f"Calibrate again even when the --load directory holds {CALIBRATION_JSON} of the "
        "same layout, budget and model (a fit of other settings is always refit).",
    ),
    Setting(
        flag="--dynamic-batch-calibration-output",
        parse=str,
        help=f"Directory for {CALIBRATION_YAML} (load it with --dynamic-batch-config) and "
        f"{CALIBRATION_JSON}; default: --save.",
    ),
)


def _check_table(rows: Tuple[Setting, ...]) -> None:
    """Every name, flag and older spelling belongs to one row."""
    seen: Dict[str, str] = {}
    for row in rows:
        keys = [row.flag, *(row.cli.aliases if row.cli else ()), *([row.name] if row.name else [])]
        for key in keys:
            assert key not in seen, f"{key} names two settings ({seen[key]}, {row.flag})"
            seen[key] = row.flag


_check_table(SETTINGS)


def setting(key: str) -> Setting:
    """The row of a setting, by its name (config field) or any of its flags."""
    for row in SETTINGS:
        if key in (row.name, row.flag) or (row.cli is not None and key in row.cli.aliases):
            return row
    raise KeyError(f"no setting named {key!r} in megatron_dynbatch.settings.SETTINGS")


def config_settings() -> Tuple[Setting, ...]:
    """The rows that are config settings (YAML keys), in the dataclass's field order."""
    return tuple(row for row in SETTINGS if row.name is not None)


def cli_settings(command: str) -> Tuple[Setting, ...]:
    """The rows ``megatron-dynbatch <command>`` takes."""
    return tuple(row for row in SETTINGS if row.cli is not None and command in row.cli.commands)


def add_training_args(group: Any) -> None:
    """Add every setting's training flag to Megatron-LM's argument group, in table order."""
    for row in SETTINGS:
        group.add_argument(row.flag, **row.argparse_kwargs())


def add_cli_args(
    group: Any,
    command: str,
    *,
    only: Optional[Tuple[str, ...]] = None,
    skip: Tuple[str, ...] = (),
) -> Any:
    """Add the settings ``command`` takes to its parser (or one of its groups): the training
    flag, shown in ``--help``, and each older spelling, hidden. ``only`` / ``skip``: these rows
    alone / not these, by flag. Returns ``group``."""
    for row in cli_settings(command):
        if (only is not None and row.flag not in only) or row.flag in skip:
            continue
        kwargs = row.argparse_kwargs(command)
        group.add_argument(row.flag, **kwargs)
        for alias in row.cli.aliases:
            hidden = {k: v for k, v in kwargs.items() if k not in ("required", "action")}
            hidden.update(help=argparse.SUPPRESS, default=argparse.SUPPRESS, action=OldSpelling)
            group.add_argument(alias, **hidden)
    return group


#: Where the CLI's namespace records the older spellings a command line used (flag -> old one).
OLD_SPELLINGS_DEST = "old_spellings"


class OldSpelling(argparse._StoreAction):
    """argparse ``action`` of an older spelling: stores like the setting's flag and records the
    spelling the command line used, so messages answer in it."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        used = dict(getattr(namespace, OLD_SPELLINGS_DEST, None) or {})
        used[setting(option_string).flag] = option_string
        setattr(namespace, OLD_SPELLINGS_DEST, used)


def _yaml_value(value: Any) -> str:
    if value is None or value is REQUIRED:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def reference_yaml() -> str:
    """The text of ``configs/dynbatch.yaml``: every config setting with its default and doc."""

    def comment(text: str) -> str:
        return textwrap.fill(
            text,
            width=100,
            initial_indent="# ",
            subsequent_indent="# ",
            break_on_hyphens=False,
            break_long_words=False,
        )

    parts = [
        comment(
            "megatron_dynbatch: every dynamic-batching setting with its default (written from "
            "the table in megatron_dynbatch/settings.py: python -m megatron_dynbatch.settings > "
            "configs/dynbatch.yaml). Pass with --dynamic-batch-config FILE next to "
            "--use-dynamic-batch-size; a flag given on the command line overrides the value "
            'here. null means "not set in this file" (the flag, then the default, applies).'
        )
    ]
    for row in config_settings():
        block = []
        if row.yaml_heading:
            block.append(comment(row.yaml_heading))
        block.append(comment(f"{row.doc} Flag: {row.flag}."))
        value = None if row.derived_when_unset else row.default
        block.append(f"{row.name}: {_yaml_value(value)}")
        parts.append("\n".join(block))
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    print(reference_yaml(), end="")
