"""The ``megatron-dynbatch`` command: ``plan`` a schedule, ``verify`` it on real Megatron-Core,
``calibrate`` the cost model from measured step times, ``pretrain`` a GPT with Megatron-LM's
``pretrain()`` (under torchrun; every other argument is Megatron-LM's or ours).

``plan`` and ``verify`` take the run's settings under their training flags, built from the settings
table (:mod:`megatron_dynbatch.settings`; the older spellings ``--layout``, ``--cost-*``,
``--min-gain``, ``--planner`` are hidden aliases there). ``plan`` imports only the pure planner, so
it answers in milliseconds without torch. User errors
(``ValueError``) print one line to stderr and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from typing import List, Optional

from megatron_dynbatch.errors import DynBatchRuntimeError, DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.model_args import add_model_args
from megatron_dynbatch.planning.spec import ceil_div, round_up
from megatron_dynbatch.runtime.aggregation import AGGREGATIONS
from megatron_dynbatch.settings import OLD_SPELLINGS_DEST, add_cli_args, cli_settings, setting
from megatron_dynbatch.tools.wording import flags_in_place

__all__ = ["main", "build_parser"]


def _add_layout_args(parser: argparse.ArgumentParser, command: str) -> None:
    """The parallel layout both subcommands take, then the settings ``command`` takes from the
    settings table (under their training flags; older spellings hidden)."""
    parser.add_argument("--dp-size", type=int, default=1, help="data-parallel size (default 1)")
    parser.add_argument("--pp-size", type=int, default=1, help="pipeline-parallel size (default 1)")
    parser.add_argument(
        "--vpp-size", type=int, default=1, help="virtual pipeline chunks per stage (default 1)"
    )
    parser.add_argument(
        "--microbatch-group-size-per-vp-stage",
        type=int,
        default=None,
        help="Megatron's interleaving group (default: pp-size)",
    )
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--cp-size", type=int, default=1, help="context-parallel size (default 1)")
    # The memory budget and variable rows need the model flags: added beside them (plan).
    add_cli_args(parser, command, skip=_MODEL_SETTINGS)


#: Settings ``plan`` lists with Megatron's model flags (they need the model).
_MODEL_SETTINGS = ("--max-memory-gib", "--variable-seq-lengths")


class _OneLineParser(argparse.ArgumentParser):
    """A usage error is one line naming ``--help``, not the whole usage (17 lines for ``plan``).

    Subcommand parsers are made of the same class, so ``plan`` without ``--max-tokens-per-gpu``
    says so in one line too.
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_device_arg(group) -> None:
    group.add_argument(
        "--device",
        choices=DEVICES,
        default="cuda",
        help="with --num-layers: the device the default cost model assumes (cuda: a GPU in "
        "--bf16 / --fp16 / fp32; cpu: PyTorch eager on CPU cores); a training run reads its own",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="megatron-dynbatch",
        description="Dynamic token-budget micro-batching for Megatron-Core.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="plan the micro-batch schedule of a list of samples")
    plan.add_argument(
        "samples", help="SAMPLES.json: array of lengths or {length, rollout, prompt_length}"
    )
    _add_layout_args(plan, "plan")
    plan.add_argument("--json", action="store_true", help="print exactly one JSON object")
    _add_device_arg(add_cli_args(add_model_args(plan), "plan", only=_MODEL_SETTINGS[:1]))
    add_cli_args(plan, "plan", only=_MODEL_SETTINGS[1:])
    plan.add_argument(
        "--plot", default=None, metavar="FILE.png", help="draw the first step to a PNG"
    )

    verify = sub.add_parser(
        "verify", help="check dynamic batching against a reference on Megatron-Core"
    )
    _add_layout_args(verify, "verify")
    verify.add_argument(
        "--loss",
        choices=AGGREGATIONS,
        default="token-mean",
    )
    verify.add_argument("--samples", default=None, help="SAMPLES.json (default: a bundled set)")
    verify.add_argument("--json", action="store_true", help="print exactly one JSON object")
    verify.add_argument(
        "--moe",
        action="store_true",
        help="a mixture-of-experts model (4 experts, top-2, all-to-all dispatcher, router z-loss; "
        "padding and placeholders masked out of the router statistics)",
    )
    verify.add_argument(
        "--moe-ep-size", type=int, default=1, help="expert-parallel size with --moe (default 1)"
    )
    verify.add_argument(
        "--moe-z-loss-coeff",
        type=float,
        default=1e-2,
        help="router z-loss coefficient with --moe (default 0.01; 0 turns it off)",
    )

    calibrate = sub.add_parser(
        "calibrate",
        help="fit the cost model to measured step times (observations JSON -> cost YAML)",
    )
    calibrate.add_argument(
        "observations",
        help="OBSERVATIONS.json: an array of {seconds, seq_length, ranks, ...} (one per step), "
        "or '-' for stdin",
    )
    calibrate.add_argument(
        "--output", default=None, metavar="COST.yaml", help="write the --dynamic-batch-config YAML"
    )
    calibrate.add_argument(
        "--no-attention", action="store_true", help="pin the attention weight at 0"
    )
    calibrate.add_argument("--json", action="store_true", help="print exactly one JSON object")
    _add_device_arg(add_model_args(calibrate, "the default cost model whose scales are fitted"))

    # Listed for --help only: main() hands `pretrain ...` to the Megatron-LM entry before this
    # parser runs, since the arguments are Megatron-LM's (hundreds of them, parsed by Megatron).
    sub.add_parser(
        "pretrain",
        help="train a GPT with Megatron-LM's pretrain() and dynamic batching; one rank: run it "
        "under torchrun (torchrun --nproc-per-node N -m megatron_dynbatch pretrain ..., or "
        "torchrun --nproc-per-node N --no-python megatron-dynbatch pretrain ...); takes "
        "launch/pretrain_gpt_dynbatch.py's arguments",
        add_help=False,
    )
    return parser


def _unique_keys(pairs):
    """``object_pairs_hook`` that refuses duplicate keys (``json`` silently keeps the last)."""
    keys = [key for key, _ in pairs]
    duplicated = sorted({key for key in keys if keys.count(key) > 1})
    if duplicated:
        raise DynBatchValueError(f"duplicate key(s) {duplicated} in an object; give every key once")
    return dict(pairs)


def _read_json(path: str, what: str = "SAMPLES.json"):
    """Decoded JSON of ``path`` (``-``: stdin); unreadable or invalid files are ValueErrors that
    name the file as the command's synopsis does (``what``)."""
    try:
        if path == "-":
            return json.load(sys.stdin, object_pairs_hook=_unique_keys)
        # utf-8-sig: a file saved with a byte-order mark (some Windows editors) reads as without.
        with open(path, encoding="utf-8-sig") as handle:
            return json.load(handle, object_pairs_hook=_unique_keys)
    except OSError as exc:
        raise DynBatchValueError(f"cannot read {what} {path!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise DynBatchValueError(f"{path!r} is not valid JSON: {exc}") from None
    except RecursionError:
        shape = (
            "a flat array of lengths or {length, rollout, prompt_length} objects"
            if what == "SAMPLES.json"
            else "an array of {seconds, seq_length, ranks, ...} objects, one per step"
        )
        raise DynBatchValueError(f"{path!r} is nested too deeply; {what} is {shape}.") from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):
            # Python's advice (sys.set_int_max_str_digits) is for programmers, not for a length.
            raise DynBatchValueError(
                f"{path!r} holds an integer of thousands of digits; a sample length is a token "
                "count, at most 2**40."
            ) from None
        raise DynBatchValueError(f"{path!r}: {exc}") from None


def _load_samples(path: str):
    from megatron_dynbatch.planning import parse_samples_json

    return parse_samples_json(_read_json(path))


#: The ``DynBatchConfig`` fields both ``plan`` and ``verify`` set (their rows in the settings
#: table; argparse stores each under its field's name).
CLI_FIELDS = tuple(row.name for row in cli_settings("verify") if row.name is not None)


def _parallel_layout(args):
    """The layout the flags both subcommands share describe."""
    from megatron_dynbatch.planning import ParallelLayout

    return ParallelLayout(
        dp_size=args.dp_size,
        pp_size=args.pp_size,
        vpp_size=args.vpp_size,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
        tp_size=args.tp_size,
        cp_size=args.cp_size,
    )


def _planner_config(args, *, memory=None, longest=None):
    """The planner's config from the flags both subcommands share.

    Built through ``config_from_mapping`` and :meth:`DynBatchConfig.planner_config`, the one place a ``PlannerConfig`` is made
    outside the planner, so the CLI plans exactly as training does.
    """
    from megatron_dynbatch.config import config_from_mapping

    parallel = _parallel_layout(args)
    values = {field: getattr(args, field) for field in CLI_FIELDS}
    if values.get("max_tokens_per_gpu") is None:
        if getattr(args, "max_memory_gib", None) is None:
            raise DynBatchValueError(
                "pass --max-tokens-per-gpu (the token budget of one micro-batch), or "
                "--max-memory-gib with the model flags (--num-layers, --hidden-size, ...)."
            )
        # Only a memory budget, as in training (a docs probe: plan required the flag).
        from megatron_dynbatch.planning.spec import memory_only_budget

        values["max_tokens_per_gpu"] = memory_only_budget(args.cp_size)
    if getattr(args, "planner", None) is not None:
        values["planner"] = args.planner
    variable = None
    if getattr(args, "num_layers", None) is not None:
        # Megatron's model flags: the first plan the Megatron-LM entry runs (on --device), with
        # the model's default cost model and (unless --no-variable-seq-lengths) its own rows.
        from megatron_dynbatch.integrations.megatron_lm.arguments import (
            VARIABLE_ROW_MULTIPLE,
            apply_default_cost,
        )

        _check_model_shape(args, "cost")
        args.group_query_attention = args.num_query_groups is not None
        cpu = getattr(args, "device", "cuda") == "cpu"
        if cpu and values.get("cost_attention") is None:
            # The entry on CPU runs Megatron's local implementation, resolved as training
            # resolves it (a probe: plan --device cpu priced packed rows per segment, as on GPUs).
            from megatron_dynbatch.config import attention_from_megatron

            values["cost_attention"] = attention_from_megatron(
                "local", None, values["layout"] or "packed"
            )
        apply_default_cost(values, _physical_cost(args, parallel, values))
        # Variable rows by default only where they can run and pay: a padded [B, S] row has the
        # longest sample's length, and on CPU (gloo) the entry keeps one row a step, as it
        # decides (variable_seq_lengths(): NCCL only).
        packed = (values["layout"] or "packed") == "packed"
        wanted = args.variable_seq_lengths or (
            args.variable_seq_lengths is None and packed and not cpu
        )
        variable = VARIABLE_ROW_MULTIPLE if wanted else None
    elif getattr(args, "variable_seq_lengths", None):
        from megatron_dynbatch.integrations.megatron_lm.arguments import VARIABLE_ROW_MULTIPLE

        variable = VARIABLE_ROW_MULTIPLE
    if getattr(args, "variable_seq_lengths", None) and values["layout"] == "padded":
        layout = setting("layout").flag
        # Planner 'fixed' plans padded rows only: dropping the layout was refused next for it.
        which = "drop one of them"
        if getattr(args, "planner", None) == "fixed":
            which = "drop --variable-seq-lengths (planner 'fixed' plans padded rows only)"
            if longest is not None:
                # It pads every sample to the longest: the cap too, at once (a re-probe).
                row = round_up(longest, parallel.sample_multiple)
                budget = args.max_tokens_per_gpu
                if budget is not None and budget * parallel.cp_size < row:
                    least = ceil_div(row, parallel.cp_size)
                    which += f" and raise --max-tokens-per-gpu to at least {least}"
        raise DynBatchValueError(
            f"--variable-seq-lengths needs {layout} packed (padded [B, S] rows all have the "
            f"longest sample's length); {which}."
        )
    config = config_from_mapping(values)
    return config.planner_config(
        parallel,
        row_multiple=variable,
        memory=memory(config, parallel) if memory else None,
    )


def _check_model_shape(args, what: str) -> None:
    """``--num-layers`` needs the rest of the model's shape (the ``what`` model is built of it)."""
    missing = [f for f in ("hidden_size", "num_attention_heads") if getattr(args, f) is None]
    if missing:
        named = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise DynBatchValueError(
            f"--num-layers given without {named}; the {what} model needs the model's shape."
        )


#: ``--device``: the default cost model's device rates (training reads the machine it runs on).
DEVICES = ("cuda", "cpu")


def _physical_cost(args, parallel, values):
    """The Megatron-LM entry's default cost model of the model flags
    (:func:`~megatron_dynbatch.planning.model_cost.physical_cost`) on ``--device``, for the
    attention the settings in ``values`` resolve (``--dynamic-batch-cost-attention``, else by
    layout), as training derives it."""
    from megatron_dynbatch.integrations.megatron_lm.model_args import model_dims_from_args
    from megatron_dynbatch.planning.model_cost import CPU_RATES, GPU_RATES, physical_cost
    from megatron_dynbatch.planning.spec import CostModel

    attention = CostModel(attention=values["cost_attention"]).attention_kind(
        values["layout"] or "packed"
    )
    if getattr(args, "device", "cuda") == "cpu":
        rates = CPU_RATES
    else:
        rates = GPU_RATES["bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"]
    return physical_cost(model_dims_from_args(args, parallel), attention, rates)


def _memory_limit(args, longest: Optional[int] = None):
    """``plan``'s memory model and budget from Megatron's model flags (``None`` without them):
    a function of the run's config and layout, which it needs to know the attention and stages.
    The model lands in ``args.memory_model`` for the report. ``longest``: the longest sample, for
    a budget under one padded sample under ``--oversize-samples error``, which then names what
    that sample needs (a probe: "at least 0.170", then refused at it for "at least 1.434")."""
    args.memory_model = None
    if args.num_layers is None:
        if args.max_memory_gib is not None:
            raise DynBatchValueError(
                "--max-memory-gib needs the model to predict its memory: pass Megatron's "
                "--num-layers, --hidden-size, --num-attention-heads (and --vocab-size, ...)."
            )
        return None
    _check_model_shape(args, "memory")
    if args.fp16 and args.bf16:
        raise DynBatchValueError(
            "--fp16 and --bf16 both given; Megatron-LM trains in one of them: keep one."
        )
    from megatron_dynbatch.config import GIB_RANGE, is_gib

    gib = args.max_memory_gib
    if gib is not None and not is_gib(gib):
        raise DynBatchValueError(
            f"--max-memory-gib {gib} must be a number of GiB > 0 ({GIB_RANGE}: one GPU's memory "
            "budget, e.g. 80), or leave it out to plan by --max-tokens-per-gpu alone."
        )

    def build(config, parallel):
        from megatron_dynbatch.integrations.megatron_lm.model_args import memory_model_from_flags
        from megatron_dynbatch.planning.memory import MemoryLimit, gib_to_bytes

        args.group_query_attention = args.num_query_groups is not None
        attention = config.cost_model().attention_kind(config.layout)
        args.memory_model = memory_model_from_flags(args, parallel, attention)
        if args.max_memory_gib is None:
            return None
        limit = MemoryLimit(
            model=args.memory_model,
            budget_bytes=gib_to_bytes(args.max_memory_gib),
            row_multiple=parallel.sample_multiple,
        )
        if longest and args.oversize_samples == "error":
            _check_budgets_hold_longest(args, limit, config, parallel, longest)
        return limit

    return build


def _memory_report(plan, model, config) -> dict:
    """Per step, every pipeline stage's predicted peak (bytes) of the planned micro-batches."""
    from megatron_dynbatch.planning.memory import predicted_step_peaks, step_shapes

    steps = []
    for step in plan.steps:
        shapes = step_shapes(
            step.num_microbatches,
            step.micro_batch_size,
            step.seq_length,
            step.row_lengths,
            config.parallel.dp_size,
        )
        steps.append([round(p.total) for p in predicted_step_peaks(model, shapes)])
    return {
        "budget_bytes": None if config.memory is None else config.memory.budget_bytes,
        "static_bytes_per_stage": [round(model.resting(s)) for s in model.dims.stages()],
        "predicted_peak_bytes_per_stage": steps,
        "note": "weights, gradients, optimizer state and activations; not the CUDA context",
    }


def _format_table(plan, config) -> str:
    header = (
        f"{'step':>4} {'rollouts':>8} {'samples':>7} {'M/rank':>6} {'S':>7} {'B':>3} "
        f"{'fill':>6} {'dp_imb':>7} {'placeh':>6} {'oversize':>8}"
    )
    lines = [
        f"layout={plan.layout} dp_size={plan.dp_size} token_cap={plan.token_cap} "
        f"({config.cap_source})",
        header,
    ]
    for s, step in enumerate(plan.steps):
        num_samples = sum(len(mb) for rank in step.ranks for mb in rank)
        lines.append(
            f"{s:>4} {step.num_rollouts:>8} {num_samples:>7} {step.num_microbatches:>6} "
            f"{step.seq_length:>7} {step.micro_batch_size:>3} {step.fill:>6.3f} "
            f"{step.dp_imbalance:>7.4f} {step.num_placeholders:>6} {len(step.oversize_samples):>8}"
        )
    st = plan.stats
    lines.append(
        f"total: {st.num_samples} samples, {st.num_microbatches} micro-batches "
        f"({st.num_placeholders} placeholders; lower bound {st.lower_bound_microbatches} real), "
        f"fill {st.fill:.3f}, worst DP imbalance {st.dp_imbalance:.4f}"
    )
    if st.oversize_samples:
        lines.append(f"oversize samples (alone, over the cap): {list(st.oversize_samples)}")
    if st.truncated_samples:
        lines.append(
            f"truncated to the cap: {list(st.truncated_samples)} ({st.truncated_tokens} tokens cut)"
        )
    return "\n".join(lines)


def _check_plot_path(path: str) -> None:
    """Fail before planning if the picture cannot be written where asked."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise DynBatchValueError(
            f"--plot {path!r}: the folder {folder!r} does not exist; create it or pick another "
            "path."
        )
    if os.path.isdir(path):
        raise DynBatchValueError(
            f"--plot {path!r} is a folder; name the picture's file, e.g. "
            f"{os.path.join(path, 'step.png')!r}."
        )
    if not os.access(folder, os.W_OK):
        raise DynBatchValueError(
            f"--plot {path!r}: the folder {folder!r} is not writable; pick another path."
        )


def _check_budgets_hold_longest(args, limit, config, parallel, longest: int) -> None:
    """Under ``--oversize-samples error``, where the config would refuse a budget under one
    padded sample (memory under one micro-batch, or tokens under the sample multiple): every
    budget short of the longest sample named at once, at what it needs (probes: "at least
    0.170", then "at least 1.434"; the token budget named, then the memory budget)."""
    multiple, cp = parallel.sample_multiple, parallel.cp_size
    # The token budget as given (a memory-only run has none), in tokens of a whole row.
    row_tokens = None if args.max_tokens_per_gpu is None else config.max_tokens_per_gpu * cp
    one_row = limit.row_cap(1)
    memory_short = one_row < multiple
    tokens_short = row_tokens is not None and row_tokens < multiple
    if not memory_short and not tokens_short:
        return  # the planner names what the longest sample needs (cap_to_hold), both budgets
    padded = round_up(longest, multiple)
    needs, least = [], []
    if one_row < padded:
        needs.append(f"--max-memory-gib to at least {limit.least_gib(padded):.3f}")
    if memory_short:
        least.append(f"--max-memory-gib at least {limit.least_gib(multiple):.3f}")
    if row_tokens is not None and row_tokens < padded:
        needs.append(f"--max-tokens-per-gpu to at least {ceil_div(padded, cp)}")
    if tokens_short:
        least.append(f"--max-tokens-per-gpu at least {ceil_div(multiple, cp)}")
    short = []
    if memory_short:
        model = limit.model
        resting = max(model.resting(stage) for stage in model.dims.stages()) / 2**30
        short.append(
            f"--max-memory-gib {args.max_memory_gib} (predicted at rest: {resting:.3f} GiB; a "
            "larger --tp-size or --pp-size shards it)"
        )
    if tokens_short:
        short.append(f"--max-tokens-per-gpu {args.max_tokens_per_gpu}")
    raise DynBatchValueError(
        f"{' and '.join(short)} cannot hold one micro-batch of {multiple} token(s), and under "
        f"--oversize-samples error the longest sample ({longest} tokens) must fit one; raise "
        f"{' and '.join(needs)}, or pass --oversize-samples truncate or allow with "
        f"{' and '.join(least)}."
    )


def _check_budget_holds_longest(args, lengths) -> None:
    """A token budget under one padded sample, under ``--oversize-samples error`` or planner
    ``fixed``: the config names the least budget for any sample, and the plan then refused it for
    the longest (a probe: "at least 16", then "at least 1504"). With the lengths in hand, name
    the one that plans."""
    from megatron_dynbatch.planning.spec import sample_multiple

    budget, cp = args.max_tokens_per_gpu, args.cp_size
    # Planner 'fixed' pads every sample to the longest whatever the oversize policy (a probe:
    # "at least 16", then "at least 48" from the planner).
    fixed = getattr(args, "planner", None) == "fixed"
    if args.oversize_samples != "error" and not fixed:
        return
    if not isinstance(budget, int) or not isinstance(cp, int):
        return
    if cp < 1 or not isinstance(args.tp_size, int) or args.tp_size < 1:
        return  # the config refuses the layout by name
    multiple = sample_multiple(args.tp_size, cp)
    if budget * cp >= multiple:
        return  # the planner names what the longest sample needs, if more
    longest = max(lengths)
    padded = round_up(longest, multiple)
    flag = setting("max_tokens_per_gpu").flag
    times = f" (x --cp-size={cp})" if cp > 1 else ""
    if fixed:
        # Every change it needs at once: its padded layout too (the planner names it next).
        layout = setting("layout").flag
        padded_rows = "" if args.layout == "padded" else f"pass {layout} padded and "
        policy = (
            " and --oversize-samples allow or truncate" if args.oversize_samples == "error" else ""
        )
        raise DynBatchValueError(
            f"{flag}={budget}{times} is smaller than one padded sample (a multiple of "
            f"{multiple}: --tp-size={args.tp_size}, --cp-size={cp}), and planner 'fixed' pads "
            f"every sample to the longest ({longest} tokens, {padded} padded); {padded_rows}"
            f"raise {flag} to at least {ceil_div(padded, cp)}, or pick planner 'dynbatch' with "
            f"{flag} at least {ceil_div(multiple, cp)}{policy} (it runs an oversize sample "
            "alone, or cuts it with --oversize-samples truncate)."
        )
    raise DynBatchValueError(
        f"{flag}={budget}{times} is smaller than one padded sample (a multiple of {multiple}: "
        f"--tp-size={args.tp_size}, --cp-size={cp}), and under --oversize-samples error the "
        f"longest sample ({longest} tokens, {padded} padded) must fit it; raise {flag} to at "
        f"least {ceil_div(padded, cp)}, or pass --oversize-samples truncate or allow with {flag} "
        f"at least {ceil_div(multiple, cp)}."
    )


def _cmd_plan(args) -> int:
    from megatron_dynbatch.config import megatron_setting_flags
    from megatron_dynbatch.planning import get_planner, run_planner
    from megatron_dynbatch.planning.invariants import PlanInvariantError

    if args.plot:
        _check_plot_path(args.plot)
    try:  # an unknown name fails before the samples are read, naming the flag as verify does
        get_planner(args.planner)
    except DynBatchValueError as error:
        raise DynBatchValueError(
            f"planner={args.planner!r} ({setting('planner').flag}): {error}"
        ) from None
    samples = _load_samples(args.samples)
    if args.max_memory_gib is None:  # with it, the memory limit names both (_memory_limit)
        _check_budget_holds_longest(args, samples.lengths)
    longest = max(samples.lengths)
    config = _planner_config(args, memory=_memory_limit(args, longest=longest), longest=longest)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with megatron_setting_flags():
                plan = run_planner(samples, config)
        except (DynBatchRuntimeError, PlanInvariantError) as exc:
            # A planner that cannot schedule this input (an upstream scheduler's own check), or
            # a registered planner whose plan broke a guarantee (run_planner's check).
            raise DynBatchValueError(f"{setting('planner').flag} {args.planner}: {exc}") from None
    for warning in caught:
        print(f"warning: {_spoken(flags_in_place(str(warning.message)), args)}", file=sys.stderr)
    if args.plot:
        from megatron_dynbatch.tools.plotting import plot_step

        try:
            plot_step(plan, 0, samples, config, args.plot)
        except OSError as exc:
            raise DynBatchValueError(
                f"--plot {args.plot!r}: cannot write it: {exc.strerror or exc}"
            ) from None
    if args.json:
        # Never NaN or Infinity in the public JSON (not JSON at all); the cost model's finite
        # check makes this unreachable, allow_nan=False makes sure.
        report = plan.to_dict()
        if args.memory_model is not None:
            report["memory"] = _memory_report(plan, args.memory_model, config)
        print(json.dumps(report, allow_nan=False))
    else:
        print(_format_table(plan, config))
        if args.memory_model is not None:
            memory = _memory_report(plan, args.memory_model, config)
            for s, peaks in enumerate(memory["predicted_peak_bytes_per_stage"]):
                mib = ", ".join(f"{p / 2**20:.0f}" for p in peaks)
                print(f"step {s}: predicted peak per pipeline stage (MiB): {mib}")
    if args.memory_model is not None:
        _warn_over_budget(_memory_report(plan, args.memory_model, config), args.max_memory_gib)
    return 0


def _warn_over_budget(memory: dict, gib) -> None:
    """Say on stderr (JSON or table) when a planned step's predicted peak exceeds the budget
    (issue 44: peaks of 44 MiB against a 10 MiB budget were printed without a word): an oversize
    sample runs alone over any cap, and the memory at rest alone may exceed a small budget."""
    from megatron_dynbatch.planning.memory import budget_gib

    budget = memory["budget_bytes"]
    if budget is None:
        return
    over = [
        (s, stage, peak)
        for s, peaks in enumerate(memory["predicted_peak_bytes_per_stage"])
        for stage, peak in enumerate(peaks)
        if peak > budget
    ]
    if not over:
        return
    s, stage, peak = max(over, key=lambda item: item[2])
    rest = memory["static_bytes_per_stage"][stage]
    print(
        f"warning: {len({item[0] for item in over})} step(s) are predicted to exceed "
        f"--max-memory-gib {gib:g} ({budget / 2**20:.0f} MiB); the largest, step {s}, holds "
        f"{peak / 2**20:.0f} MiB on pipeline stage {stage} ({rest / 2**20:.0f} MiB of it at "
        f"rest); raise --max-memory-gib to at least {budget_gib(peak):.3f}, or drop / truncate "
        "the samples over the cap (--oversize-samples truncate).",
        file=sys.stderr,
    )


def _cmd_verify(args) -> int:
    from megatron_dynbatch.tools.verify.cli import run_verify_cli
    from megatron_dynbatch.tools.verify.spec import MoESettings

    samples = None if args.samples is None else _read_json(args.samples)
    moe = None
    if args.moe:
        moe = MoESettings(ep_size=args.moe_ep_size, z_loss_coeff=args.moe_z_loss_coeff)
    elif args.moe_ep_size != 1:
        raise DynBatchValueError(
            f"--moe-ep-size {args.moe_ep_size} needs --moe (a dense model has no experts)."
        )
    if samples is not None:
        from megatron_dynbatch.planning import parse_samples_json
        from megatron_dynbatch.tools.verify.spec import check_verify_layout

        try:
            lengths = parse_samples_json(samples).lengths
        except DynBatchValueError:
            lengths = None  # verify names what is wrong with the file, in its words
        if lengths:
            # verify's own layout refusals first: a budget named for a layout it then refused
            # was no fix (a re-probe).
            check_verify_layout(_parallel_layout(args), moe)
            _check_budget_holds_longest(args, lengths)
    from megatron_dynbatch.config import megatron_setting_flags

    config = _planner_config(args)
    with megatron_setting_flags():
        return run_verify_cli(config, loss=args.loss, samples=samples, as_json=args.json, moe=moe)


def _cmd_calibrate(args) -> int:
    from megatron_dynbatch.errors import DynBatchValueError
    from megatron_dynbatch.planning.calibration import Observation, fit_cost_model

    data = _read_json(args.observations, "OBSERVATIONS.json")
    recorded = None
    if isinstance(data, dict):
        # A run's dynbatch_calibration.json holds its fit with the measured steps under "steps"
        # (its "observations" is the count the fit used), and the model it fitted scales of.
        recorded = data.get("prior")
        data = data.get("steps", data.get("observations"))
    if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
        raise DynBatchValueError(
            f"{args.observations!r} must hold a JSON array of observation objects, "
            '{"observations": [...]}, or a run\'s dynbatch_calibration.json ({"steps": [...]}), '
            "one object per measured step."
        )
    observations = [Observation.from_dict(item) for item in data]
    prior = _calibration_prior(args, recorded, observations)
    fit = fit_cost_model(observations, prior=prior, fit_attention=not args.no_attention)
    yaml_text = fit.to_yaml()
    if args.output is not None:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(yaml_text)
    if args.json:
        model = fit.cost_model()
        print(
            json.dumps(
                {
                    "calibration": fit.to_dict(),
                    "cost": {
                        "cost_token_weight": model.token_weight,
                        "cost_attention_weight": model.attention_weight,
                        "cost_microbatch_overhead": model.microbatch_overhead,
                    },
                    "output": args.output,
                }
            )
        )
    else:
        print(fit.summary())
        if args.output is None:
            print(yaml_text, end="")
    return 0


def _calibration_prior(args, recorded, observations):
    """The model ``calibrate`` fits scales of, as training does: the model flags' default
    (``--num-layers`` ...: the Megatron-LM entry's :func:`_physical_cost` on ``--device``), else
    the one a run recorded in its ``dynbatch_calibration.json`` (``"prior"``); ``None`` (free
    weights, one may come out 0) without either."""
    from megatron_dynbatch.planning import ParallelLayout
    from megatron_dynbatch.planning.spec import CostModel

    if args.num_layers is not None:
        _check_model_shape(args, "cost")
        args.group_query_attention = args.num_query_groups is not None
        first = observations[0] if observations else None
        parallel = ParallelLayout(
            pp_size=first.pp_size if first else 1, vpp_size=first.vpp_size if first else 1
        )
        layout = first.layout if first else "packed"
        values = {"cost_attention": first.attention if first else None, "layout": layout}
        return _physical_cost(args, parallel, values).cost_model()
    if isinstance(recorded, dict):
        try:
            return CostModel(**recorded)
        except TypeError as exc:
            raise DynBatchValueError(
                f'{args.observations!r}: its "prior" is not a cost model: {exc}'
            ) from None
    return None


#: What the Megatron-LM entry calls itself in its one-line errors under this command.
PRETRAIN_PROGRAM = "megatron-dynbatch pretrain"


def main(argv: Optional[List[str]] = None) -> int:
    from megatron_dynbatch.planning.invariants import PlanInvariantError
    from megatron_dynbatch.planning.spec import layout_flags

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["pretrain"]:
        from megatron_dynbatch.integrations.megatron_lm.launch import run_program

        sys.argv = [PRETRAIN_PROGRAM, *argv[1:]]  # Megatron's parser reads sys.argv
        run_program()
    args = build_parser().parse_args(argv)
    try:
        if args.command == "calibrate":
            # Its layouts come from the observations file, whose keys (pp_size, ...) its messages
            # name; plan's and verify's flags are not calibrate's (a probe was told --pp-size).
            code = _cmd_calibrate(args)
        else:
            with layout_flags("megatron-dynbatch"):
                code = _cmd_plan(args) if args.command == "plan" else _cmd_verify(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader closed the pipe early (``plan --json | head``): stop quietly, as a shell
        # tool does, and keep Python's exit-time flush from raising again on the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, PlanInvariantError) as exc:
        # calibrate's advice is for a run (the training flags); plan and verify answer in the
        # spellings their command line used. A registered planner's broken plan is refused here
        # too (run_planner's check), before verify starts its ranks.
        message = (
            str(exc) if args.command == "calibrate" else _spoken(flags_in_place(str(exc)), args)
        )
        print(f"megatron-dynbatch {args.command}: error: {message}", file=sys.stderr)
        return 2


def _spoken(message: str, args) -> str:
    """``message`` in the spellings of the command line: where it used an older spelling of a
    setting (``--layout``, ``--cost-attention-weight``, ...), every flag with an older spelling is
    named by it (``--dynamic-batch-layout`` is ``--layout`` there); otherwise the flags stay."""
    if not getattr(args, OLD_SPELLINGS_DEST, None):
        return message
    for row in cli_settings(args.command):
        if row.cli.aliases:
            old = row.cli.aliases[0]
            message = re.sub(rf"{re.escape(row.flag)}\b(?!-)", old, message)
    return message


if __name__ == "__main__":
    sys.exit(main())
