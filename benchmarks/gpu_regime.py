"""The GPU regime on paper: ours as each host runs it against the peers' schedulers, with an
H100-like cost model built from the models' FLOPs.

Sixteen cases: a 7B model at tp 2 pp 4 and a 32B model at tp 8 pp 4 (Qwen2.5-7B / -32B
dimensions); 512-sample steps of long-tailed GRPO groups and of multi-turn agentic rollouts;
dp 4 and 16; vpp 1 and 2; a budget of 16,384 tokens per GPU. Every schedule is scored with the
same *true* cost, one micro-batch through the whole pipeline on one tensor-parallel group, in
microseconds:

* linear work: the model's linear FLOPs per token (:func:`.model_cost.forward_flops`) over
  ``tp x`` the achieved GEMM rate, on every position of the row (padding included);
* attention per segment: the attention FLOPs of each sample (and of the row's padding tail)
  over ``tp x`` the achieved attention rate;
* a fixed cost per micro-batch and stage (launches, Python), times ``pp``;
* pipeline p2p: ``pp - 1`` sends of the row's activations (``2 * h / tp`` bytes a token with
  sequence parallelism) at the link's bandwidth, plus their latency.

The assumed rates are printed with the results; ``--weights FILE`` (JSON) replaces them with
measured ones: either the rates (``linear_tflops``, ``attention_tflops``,
``microbatch_overhead_ms``, ``p2p_latency_us``, ``p2p_gbytes_per_s``) or, per model
(``{"models": {"7b": {"token_weight": ..., "attention_weight": ..., "microbatch_overhead":
...}}}``), the cost weights themselves in microseconds (what a GPU calibration fits).

Schedulers, each as a ratio of its simulated step (slowest DP rank's pipeline, Megatron's 1F1B or
interleaved order, backward 2x forward) to the bound (all real work over ``dp * pp`` GPUs, no
padding, no overhead, no bubble), the gap split into

* **padding**: computed work of padding and placeholders, mean over ranks;
* **overhead**: the fixed per-micro-batch cost, mean over ranks;
* **imbalance**: the slowest rank's work above the mean;
* **bubble**: the rest, pipeline idle time.

Ours (:data:`OURS`):

* ``told``: the planner told the true cost, per-micro-batch rows (multiple 64);
* ``told, thorough``: the same with ``--dynamic-batch-planner dynbatch-thorough`` (several times
  the planning CPU for a step simulated about 1% faster);
* ``Megatron-LM (GPU default)``: the plan the Megatron-LM entry runs first, before calibration,
  for a model whose dimensions it knows, over NCCL (its arguments through
  :func:`~megatron_dynbatch.integrations.megatron_lm.arguments.dynbatch_config_from_args` and
  :func:`~megatron_dynbatch.integrations.megatron_lm.arguments.variable_seq_lengths`);
* ``Megatron-LM (before: uniform, tokens only)``: the entry's default before issue 35 (no model
  dimensions read, uniform rows);
* ``slime``: slime's drop-in, :func:`megatron_dynbatch.adapters.slime.build_dp_schedule`, rows as
  slime's ``get_batch`` pads them (``tp * 128``);
* ``verl``: our verl engine planning each rank's share of verl's own DP split.

Peers: the stand-ins of :mod:`benchmarks.baselines` (Megatron-Core's next fit, slime's first fit,
verl's Karmarkar-Karp, SkyRL, NeMo-RL's FFD / MFFD, fixed micro-batches), each scored with
per-micro-batch rows (multiple 64: every peer as if it ran Megatron with
``variable_seq_lengths``) and with one row per step, whichever is faster. ``best peer`` is the
fastest that keeps the budget.

Run: ``.venv/bin/python -m benchmarks.gpu_regime [--weights FILE.json] [--seeds 0,1,2]
[--markdown] [--peers] [--floor] [--json]`` (about 30 s a seed). ``--markdown`` prints ``docs/benchmarks.md``'s
tables; ``--peers`` ours (told) and every peer per case, step / bound with the bubble's share of
the step; ``--floor`` the best ramp of each case's work made divisible (:func:`ramp_floor`: a
reference, not a bound); other seeds draw held-out workloads of the same families.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import types
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks.baselines import BASELINES, BaselineFailure
from benchmarks.lengths import LengthSet, grpo_lengths, multi_turn_lengths
from benchmarks.metrics import evaluate
from megatron_dynbatch.adapters.slime import build_dp_schedule
from megatron_dynbatch.integrations.megatron_lm.arguments import (
    VARIABLE_ROW_MULTIPLE,
    add_dynamic_batch_args,
    dynbatch_config_from_args,
    variable_seq_lengths,
)
from megatron_dynbatch.integrations.verl.engine import plan_verl_batch, verl_planner_config
from megatron_dynbatch.planning import CostModel, ParallelLayout, plan_schedule
from megatron_dynbatch.planning.cost import microbatch_cost
from megatron_dynbatch.planning.model_cost import forward_flops
from megatron_dynbatch.planning.model_dims import ModelDims
from megatron_dynbatch.planning.simulate import BACKWARD_TO_FORWARD_RATIO, pipeline_makespan
from megatron_dynbatch.planning.spec import (
    DEFAULT_PLANNER,
    THOROUGH_PLANNER,
    PlannerConfig,
    round_up,
)

__all__ = ["Assumptions", "Case", "MODELS", "cases", "run_case", "true_cost"]

#: Per-micro-batch rows of ours (told) and of the peers: the Megatron-LM entry rounds to 64.
ROW_MULTIPLE = 64
#: Tokens per GPU of one micro-batch.
CAP = 16384
#: Samples of a step.
STEP_SAMPLES = 512
#: The peers: the stand-ins, and verl kept within the cap (its count raised until it fits).
PEERS = dict(BASELINES, verl_kk_capped=functools.partial(BASELINES["verl_kk"], keep_cap=True))
#: Behind the best peer by more than this counts as a loss.
TOLERANCE = 0.005


@dataclass(frozen=True)
class Assumptions:
    """What the true cost assumes of the GPU (an H100 SXM in bf16)."""

    linear_tflops: float = 600.0
    """Achieved dense GEMM rate (989 peak; 60% is what large Megatron GEMMs reach)."""
    attention_tflops: float = 400.0
    """Achieved flash-attention rate over the causal triangle."""
    microbatch_overhead_ms: float = 1.5
    """Fixed cost of one micro-batch on one stage, forward (launches, Python); backward 2x."""
    p2p_latency_us: float = 30.0
    """Latency of one pipeline send (NCCL over InfiniBand)."""
    p2p_gbytes_per_s: float = 25.0
    """Bandwidth of one GPU's pipeline link (NDR 200 Gb/s per GPU)."""


#: Qwen2.5-7B and Qwen2.5-32B: (dims without layout, tp, pp).
MODELS: Dict[str, Tuple[Dict[str, Any], int, int]] = {
    "7b": (
        dict(
            num_layers=28,
            hidden_size=3584,
            num_attention_heads=28,
            num_query_groups=4,
            ffn_hidden_size=18944,
            vocab_size=152064,
            gated_linear_unit=True,
        ),
        2,
        4,
    ),
    "32b": (
        dict(
            num_layers=64,
            hidden_size=5120,
            num_attention_heads=40,
            num_query_groups=8,
            ffn_hidden_size=27648,
            vocab_size=152064,
            gated_linear_unit=True,
        ),
        8,
        4,
    ),
}


@dataclass(frozen=True)
class Case:
    label: str
    model: str
    dims: ModelDims
    samples: LengthSet
    parallel: ParallelLayout


def _workload(family: str, seed: int) -> LengthSet:
    if family == "grpo":
        # Long-tailed GRPO groups of 8: hard prompts run to the budget (clipped there).
        return grpo_lengths(
            STEP_SAMPLES // 8, 8, prompt_median=512, response_median=2048, max_len=CAP, seed=seed
        )
    # Agentic: multi-turn rollouts, one sample a turn (its whole context so far), the first 512
    # samples (the last rollout cut after a turn).
    rollouts = multi_turn_lengths(STEP_SAMPLES, turn_median=1536, max_len=CAP, seed=seed)
    n = STEP_SAMPLES
    return LengthSet(rollouts.lengths[:n], rollouts.rollout_ids[:n], rollouts.prompt_lengths[:n])


def cases(seed: int = 0) -> List[Case]:
    """The sixteen cases (``seed`` draws other workloads of the same families)."""
    result = []
    for model, (dims, tp, pp) in MODELS.items():
        for family in ("grpo", "agentic"):
            samples = _workload(family, seed)
            for vpp in (1, 2):
                for dp in (4, 16):
                    parallel = ParallelLayout(dp_size=dp, pp_size=pp, vpp_size=vpp, tp_size=tp)
                    label = f"{model} {family} vpp{vpp} dp{dp}"
                    result.append(
                        Case(label, model, ModelDims(**dims, parallel=parallel), samples, parallel)
                    )
    return result


def true_cost(
    case: Case, assumed: Assumptions, weights: Optional[Dict[str, Any]] = None
) -> CostModel:
    """The true cost of one micro-batch through the pipeline of one TP group (microseconds):
    the assumed rates, or the weights a GPU calibration measured (``weights["models"]``)."""
    override = (weights or {}).get("models", {}).get(case.model)
    if override:
        return CostModel(
            token_weight=override["token_weight"],
            attention_weight=override["attention_weight"],
            microbatch_overhead=override["microbatch_overhead"],
        )
    linear, quadratic = forward_flops(case.dims)
    tp, pp = case.parallel.tp_size, case.parallel.pp_size
    us = 1e6
    token = linear / (tp * assumed.linear_tflops * 1e12) * us
    # Sequence parallelism sends 1/tp of a token's activations (bf16) across each stage boundary.
    p2p_token = (pp - 1) * 2 * case.dims.hidden_size / tp / (assumed.p2p_gbytes_per_s * 1e9) * us
    attention = quadratic / (tp * assumed.attention_tflops * 1e12) * us
    overhead = pp * assumed.microbatch_overhead_ms * 1e3 + (pp - 1) * assumed.p2p_latency_us
    return CostModel(
        token_weight=token + p2p_token, attention_weight=attention, microbatch_overhead=overhead
    )


def _evaluate(case: Case, ranks, cost: CostModel, row_multiple, layout="packed", dummies=()):
    m = evaluate(
        ranks,
        case.samples.lengths,
        token_cap=CAP,
        layout=layout,
        cost=cost,
        sample_multiple=case.parallel.sample_multiple,
        dummy_lengths=dummies,
        row_multiple=row_multiple,
    )
    return _breakdown(case, m["microbatch_costs"], cost, m["over_cap_microbatches"])


def _with_rows(case: Case, ranks, rows, cost: CostModel) -> Dict[str, Any]:
    """A schedule that runs the rows given (``rows[r][m]``: slime's ``DPSchedule.row_lengths``)."""
    lengths, multiple = case.samples.lengths, case.parallel.sample_multiple
    costs = []
    over = 0
    for rank, rank_rows in zip(ranks, rows, strict=True):
        rank_costs = []
        for mb, row in zip(rank, rank_rows, strict=True):
            sizes = [round_up(lengths[i], multiple) for i in mb]
            over += len(mb) > 1 and sum(sizes) > CAP
            rank_costs.append(microbatch_cost(cost, "packed", row, 1, sizes, [0] * len(sizes)))
        costs.append(rank_costs)
    return _breakdown(case, costs, cost, over)


def _breakdown(case: Case, microbatch_costs, cost: CostModel, over_cap: int) -> Dict[str, Any]:
    """Step / bound and the gap's parts (each over the bound)."""
    parallel = case.parallel
    ratio = 1.0 + BACKWARD_TO_FORWARD_RATIO
    real = sum(cost.cost(length, 0) for length in case.samples.lengths) * ratio
    gpus = parallel.dp_size * parallel.pp_size
    bound = real / gpus
    rank_work = [sum(rank) * ratio for rank in microbatch_costs]
    overhead = sum(len(rank) for rank in microbatch_costs) * cost.overhead * ratio
    total = sum(rank_work)
    step = max(
        pipeline_makespan(rank, parallel.pp_size, parallel.vpp_size, parallel.group_size)
        for rank in microbatch_costs
    )
    return {
        "step": step / bound,
        "padding": (total - overhead - real) / gpus / bound,
        "overhead": overhead / gpus / bound,
        "imbalance": (max(rank_work) - total / parallel.dp_size) / parallel.pp_size / bound,
        "bubble": (step - max(rank_work) / parallel.pp_size) / bound,
        "M": len(microbatch_costs[0]),
        "over_cap": over_cap,
    }


def _plan(case: Case, config: PlannerConfig) -> Tuple[List[List[List[int]]], Any]:
    ls = case.samples
    plan = plan_schedule(ls.lengths, ls.rollout_ids, ls.prompt_lengths, config=config)
    [step] = plan.steps
    return [[list(mb) for mb in rank] for rank in step.ranks], step


def _told(case: Case, cost: CostModel, planner: str = DEFAULT_PLANNER) -> Dict[str, Any]:
    """Ours told the true cost, per-micro-batch rows."""
    config = PlannerConfig(
        planner=planner,
        max_tokens_per_gpu=CAP,
        parallel=case.parallel,
        cost=cost,
        variable_row_lengths=True,
        row_multiple=ROW_MULTIPLE,
        oversize_samples="allow",
    )
    ranks, step = _plan(case, config)
    return _evaluate(case, ranks, cost, ROW_MULTIPLE if step.row_lengths else None)


def megatron_args(case: Case, variable: Optional[bool] = None, dims: bool = True):
    """The Megatron-LM entry's arguments for the case (the model's own flags when ``dims``)."""
    argv = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(CAP)]
    if variable is not None:
        argv.append("--variable-seq-lengths" if variable else "--no-variable-seq-lengths")
    args = add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(argv)
    args.oversize_samples = "allow"
    if dims:
        d = case.dims
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
            setattr(args, name, getattr(d, name))
        args.group_query_attention = d.num_query_groups != d.num_attention_heads
        args.num_query_groups = d.num_query_groups
        args.swiglu = d.gated_linear_unit
        args.padded_vocab_size = d.vocab_size
    return args


def _megatron_lm(case: Case, cost: CostModel, backend: str, dims: bool = True) -> Dict[str, Any]:
    """The plan the Megatron-LM entry runs first (before calibration) on ``backend``."""
    args = megatron_args(case, dims=dims)
    config = dynbatch_config_from_args(args)
    variable = variable_seq_lengths(args, backend, config.layout)
    planner = config.planner_config(
        case.parallel, row_multiple=VARIABLE_ROW_MULTIPLE if variable else None
    )
    ranks, step = _plan(case, planner)
    return _evaluate(case, ranks, cost, VARIABLE_ROW_MULTIPLE if step.row_lengths else None)


def _slime(case: Case, cost: CostModel) -> Dict[str, Any]:
    """slime's drop-in as its rollout manager calls it, rows as its ``get_batch`` pads them."""
    d, parallel = case.dims, case.parallel
    args = types.SimpleNamespace(
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=CAP,
        micro_batch_size=1,
        balance_data=False,
        balance_by_flops=False,
        tensor_model_parallel_size=parallel.tp_size,
        pipeline_model_parallel_size=parallel.pp_size,
        data_pad_size_multiplier=128,
        oversize_samples="allow",
        num_layers=d.num_layers,
        hidden_size=d.hidden_size,
        num_attention_heads=d.num_attention_heads,
        num_query_groups=d.num_query_groups,
        kv_channels=d.kv_channels,
        ffn_hidden_size=d.ffn_hidden_size,
        vocab_size=d.vocab_size,
        num_experts=None,
    )
    train = {
        "dp_size": parallel.dp_size,
        "cp_size": 1,
        "vpp_size": parallel.vpp_size,
        "microbatch_group_size_per_vp_stage": parallel.pp_size,
    }
    ids = list(range(len(case.samples.lengths)))
    schedule = build_dp_schedule(
        args, train, case.samples.lengths, global_batch_size=len(ids), rollout_indices=ids
    )
    partitions, micro_batch_indices, _, _ = schedule
    ranks = [
        [[partitions[r][j] for j in mb] for mb in micro_batch_indices[r]]
        for r in range(parallel.dp_size)
    ]
    return _with_rows(case, ranks, schedule.row_lengths, cost)


def _verl(case: Case, cost: CostModel) -> Dict[str, Any]:
    """Our verl engine: verl's own DP split (its ``_balance_batch``), each rank planned."""
    ls, parallel = case.samples, case.parallel
    theirs = BASELINES["verl_kk"](ls.lengths, dp_size=parallel.dp_size, token_cap=1 << 40)
    shards = [sorted(i for mb in rank for i in mb) for rank in theirs]
    config = verl_planner_config(
        CAP,
        pp_size=parallel.pp_size,
        vpp_size=parallel.vpp_size,
        microbatch_group_size_per_vp_stage=parallel.pp_size,
        tp_size=parallel.tp_size,
        cp_size=1,
        packed=True,
    )
    plan = plan_verl_batch([[ls.lengths[i] for i in shard] for shard in shards], config)
    ranks = [
        [[shard[j] for j in mb] for mb in rank]
        for shard, rank in zip(shards, plan.ranks, strict=True)
    ]
    return _evaluate(case, ranks, cost, ROW_MULTIPLE)


#: Ours as each host runs it: name -> scorer.
OURS = {
    "told": lambda case, cost: _told(case, cost),
    "told, thorough": lambda case, cost: _told(case, cost, THOROUGH_PLANNER),
    "Megatron-LM (GPU default)": lambda case, cost: _megatron_lm(case, cost, "nccl"),
    "Megatron-LM (before: uniform, tokens only)": lambda case, cost: _megatron_lm(
        case, cost, "gloo", dims=False
    ),
    "slime": _slime,
    "verl": _verl,
}


def run_case(
    case: Case, assumed: Assumptions, weights: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """Every scheduler on one case: step / bound and its gap's parts."""
    cost = true_cost(case, assumed, weights)
    ls = case.samples
    result: Dict[str, Any] = {"case": case.label, "ours": {}, "peers": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # slime's and the planner's notes on samples at the cap
        for name, score in OURS.items():
            result["ours"][name] = score(case, cost)
    for name, fn in PEERS.items():
        try:
            theirs = fn(
                ls.lengths,
                dp_size=case.parallel.dp_size,
                token_cap=CAP,
                microbatch_multiple=case.parallel.microbatch_multiple,
                rollout_ids=ls.rollout_ids,
            )
        except BaselineFailure as exc:
            result["peers"][name] = {"status": f"FAIL: {exc.reason}"}
            continue
        dummies = getattr(theirs, "dummy_lengths", ())
        if name == "fixed_mbs":
            scored = _evaluate(case, theirs, cost, None, "padded", dummies)
        else:
            scored = min(
                (
                    _evaluate(case, theirs, cost, rows, "packed", dummies)
                    for rows in (None, ROW_MULTIPLE)
                ),
                key=lambda s: s["step"],
            )
        result["peers"][name] = scored
    kept = [(s["step"], n) for n, s in result["peers"].items() if "step" in s and not s["over_cap"]]
    result["best_peer"] = min(kept) if kept else None
    return result


def _load_weights(path: Optional[str]) -> Tuple[Assumptions, Optional[Dict[str, Any]]]:
    if path is None:
        return Assumptions(), None
    with open(path) as handle:
        data = json.load(handle)
    rates = {k: v for k, v in data.items() if k in Assumptions.__dataclass_fields__}
    return replace(Assumptions(), **rates), data


def assumption_lines(assumed: Assumptions, weights: Optional[Dict[str, Any]]) -> List[str]:
    """What the true cost assumes, and each model's resulting weights."""
    source = "Assumed (H100 SXM, bf16)"
    if weights:
        source = f"Measured on {weights.get('device', 'a GPU')} (bf16; the rest assumed)"
    lines = [
        f"{source}: linear GEMMs at {assumed.linear_tflops:.0f} TFLOP/s, "
        f"attention at {assumed.attention_tflops:.0f} TFLOP/s, a fixed "
        f"{assumed.microbatch_overhead_ms:g} ms per micro-batch and stage (forward; backward 2x), "
        f"pipeline p2p {assumed.p2p_latency_us:g} us latency and "
        f"{assumed.p2p_gbytes_per_s:g} GB/s.",
        "",
        "| model | tp x pp | linear us/token | attention ns/L^2 | overhead ms/micro-batch | "
        "attention = linear at L |",
        "|---|---|---|---|---|---|",
    ]
    for case in cases(0)[:: len(cases(0)) // len(MODELS)]:
        cost = true_cost(case, assumed, weights)
        lines.append(
            f"| {case.model} | {case.parallel.tp_size} x {case.parallel.pp_size} | "
            f"{cost.token_weight:.4f} | {cost.attention_weight * 1e3:.4f} | "
            f"{cost.overhead / 1e3:.2f} | {cost.token_weight / cost.attention_weight:,.0f} |"
        )
    return lines


def markdown_lines(results: Sequence[Dict[str, Any]]) -> List[str]:
    """The table of step / bound per case, and the gap split of ours (told) and the best peer."""
    names = list(OURS)
    lines = [
        "| case | " + " | ".join(f"ours {n}" for n in names) + " | best peer | told / best |",
        "|---|" + "---|" * (len(names) + 3),
    ]
    for r in results:
        best, peer = r["best_peer"]
        cells = [f"{r['ours'][n]['step']:.3f}" for n in names]
        told = r["ours"]["told"]["step"]
        lines.append(
            f"| {r['case']} | " + " | ".join(cells) + f" | {best:.3f} ({peer}) | "
            f"{told / best:.4f} |"
        )
    lines += [
        "",
        "Gap to the bound (fractions of it): bubble / imbalance / padding / overhead.",
        "",
        "| case | ours told | best peer |",
        "|---|---|---|",
    ]
    for r in results:
        best, peer = r["best_peer"]
        parts = ("bubble", "imbalance", "padding", "overhead")
        told = r["ours"]["told"]
        theirs = r["peers"][peer]
        lines.append(
            f"| {r['case']} | "
            + " / ".join(f"{told[p]:.3f}" for p in parts)
            + " | "
            + " / ".join(f"{theirs[p]:.3f}" for p in parts)
            + " |"
        )
    return lines


def peer_lines(results: Sequence[Dict[str, Any]]) -> List[str]:
    """Ours (told) and every peer per case: step / bound, and in brackets the bubble's share of
    the step (``†``: the peer has micro-batches over the cap; ``fails``: its code refuses)."""
    names = list(results[0]["peers"]) if results else []
    lines = [
        "| case | ours told | " + " | ".join(names) + " |",
        "|---|" + "---|" * (len(names) + 1),
    ]

    def cell(scored: Dict[str, Any]) -> str:
        if "step" not in scored:
            return "fails"
        mark = "†" if scored["over_cap"] else ""
        return f"{scored['step']:.3f}{mark} ({scored['bubble'] / scored['step']:.0%})"

    for r in results:
        cells = [cell(r["ours"]["told"])] + [cell(r["peers"][n]) for n in names]
        lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    for name in ["ours told"] + names:
        scored = [r["ours"]["told"] if name == "ours told" else r["peers"][name] for r in results]
        kept = [x for x in scored if "step" in x]
        if kept:
            steps = [x["step"] for x in kept]
            bubble = sum(x["bubble"] / x["step"] for x in kept) / len(kept)
            lines.append(
                f"{name}: step / bound mean {sum(steps) / len(steps):.3f} over {len(kept)} "
                f"case(s) it runs, bubble {bubble:.0%} of the step on average"
                + (
                    f"; over the cap in {sum(1 for x in kept if x['over_cap'])}"
                    if name != "ours told"
                    else ""
                )
            )
    return lines


def ramp_floor(case: Case, cost: CostModel) -> float:
    """Step / bound of the best ramp found for the case's work made *divisible*: each DP rank's
    share of the real work cut into micro-batches of any size (at most a full row's linear cost,
    each paying the overhead), their loads rising geometrically from a first share to a level
    and falling again, searched over counts, first shares and both ratios, replayed in
    Megatron's order.

    A reference, not a bound, either way: the search covers one family of shapes (geometric
    ramps, a few first shares and ratios, a short list of counts), so divisible work can do
    better; and its largest micro-batch costs a full row's *linear* work (``token_weight *
    cap``), while a sample at the cap also pays its attention (a quarter to a third more at
    these rates) and cannot be split, so whole samples can do worse. On the GRPO steps at dp 16
    every rank holds such a sample and its pipeline idles around it (docs/benchmarks.md)."""
    parallel = case.parallel
    pp, vpp, dp = parallel.pp_size, parallel.vpp_size, parallel.dp_size
    full = cost.token_weight * CAP
    work = sum(cost.cost(length, 0) for length in case.samples.lengths) / dp / full
    overhead = cost.overhead / full
    bound = (1.0 + BACKWARD_TO_FORWARD_RATIO) * work / pp
    best = math.inf
    counts = sorted({int(work * f) + k for f in (1, 1.2, 1.5, 2, 2.5, 3, 4) for k in (1, 2, 3, 4)})
    for m in counts:
        if vpp > 1 and m % pp:
            continue
        for first in (0.05, 0.1, 0.2, 0.3, 1.0):
            for rise in (1.2, 1.4, 1.6, 2.0):
                for fall in (1.2, 1.4, 1.6, 2.0):
                    shape = [
                        min(1.0, first * rise**k, first * fall ** (m - 1 - k)) for k in range(m)
                    ]
                    if sum(shape) < work:
                        continue
                    low, high = 0.0, 1.0
                    for _ in range(30):
                        level = (low + high) / 2
                        if sum(min(level, x) for x in shape) < work:
                            low = level
                        else:
                            high = level
                    loads = [min(high, x) + overhead for x in shape]
                    step = pipeline_makespan(loads, pp, vpp, parallel.group_size)
                    best = min(best, step / bound)
    return best


def summary_lines(results: Sequence[Dict[str, Any]]) -> List[str]:
    ratios = [(r["ours"]["told"]["step"] / r["best_peer"][0], r["case"]) for r in results]
    worst = max(ratios)
    behind = sum(1 for ratio, _ in ratios if ratio > 1 + TOLERANCE)
    lines = [
        f"ours (told) more than {TOLERANCE:.1%} behind the best cap-respecting peer: "
        f"{behind}/{len(results)}; worst told / best {worst[0]:.4f} ({worst[1]})"
    ]
    for name in OURS:
        steps = [r["ours"][name]["step"] for r in results]
        lines.append(
            f"ours {name}: step / bound {min(steps):.3f}-{max(steps):.3f} "
            f"(mean {sum(steps) / len(steps):.3f})"
        )
    bests = [r["best_peer"][0] for r in results]
    lines.append(
        f"best peer: {min(bests):.3f}-{max(bests):.3f} (mean {sum(bests) / len(bests):.3f})"
    )
    return lines


#: The intro of the docs' section (``docs/benchmarks.md``).
DOCS_INTRO = (
    "Sixteen steps of 512 samples (long-tailed GRPO groups of 8; multi-turn agentic rollouts) on "
    "a 7B model at tp 2 pp 4 and a 32B model at tp 8 pp 4 (Qwen2.5 shapes), dp 4 / 16, vpp 1 / 2, "
    "a budget of 16,384 tokens, every schedule scored with one *true* cost built from the model's "
    "FLOPs and the GPU assumptions below (`--weights FILE` replaces them with measured rates or "
    "weights). Step / bound: the slowest DP rank's simulated step over all real work on "
    "`dp * pp` GPUs with no padding, overhead or bubble. *told*: the planner given the true cost, "
    "per-micro-batch rows; *Megatron-LM (GPU default)*: the entry's first plan before "
    "calibration (the model's FLOPs ratio, overhead unknown, per-micro-batch rows on NCCL); "
    "*before*: the entry's old default (tokens only, uniform rows); *slime*, *verl*: our drop-ins "
    "as those hosts run them (slime's rows padded to tp x 128). Peers: `benchmarks/baselines.py`'s "
    "stand-ins and verl kept within the cap (its count raised until no micro-batch is over it), "
    "each with per-micro-batch rows or one row a step, whichever is faster; best peer: the "
    "fastest that keeps the cap."
)


#: Rates a GPU measured (``python -m benchmarks.gpu_rates``), shown beside the assumed ones.
MEASURED_WEIGHTS = "docs/gpu_weights.json"


def docs_section(seed: int = 0) -> List[str]:
    """The section of ``docs/benchmarks.md``: the assumed rates' tables (what ``--markdown``
    prints), then, where :data:`MEASURED_WEIGHTS` exists, the step table at a GPU's rates."""
    assumed, weights = _load_weights(None)
    results = [run_case(case, assumed, weights) for case in cases(seed)]
    lines = [
        "## GPU regime on paper (`python -m benchmarks.gpu_regime --markdown`)",
        "",
        DOCS_INTRO,
        "",
        *assumption_lines(assumed, weights),
        "",
        *markdown_lines(results),
        "",
        *summary_lines(results),
    ]
    if os.path.exists(MEASURED_WEIGHTS):
        assumed, weights = _load_weights(MEASURED_WEIGHTS)
        results = [run_case(case, assumed, weights) for case in cases(seed)]
        lines += [
            "",
            f"### At rates a GPU measured (`--weights {MEASURED_WEIGHTS}`)",
            "",
            "`python -m benchmarks.gpu_rates` timed each model's tensor-parallel shard: one "
            "layer's GEMMs on 8,192 tokens and causal `scaled_dot_product_attention` at 16,384 "
            "tokens (forward, bf16); the per-micro-batch overhead and p2p stay assumed. Attention "
            "by length (TFLOP/s): "
            + "; ".join(
                f"{name} "
                + ", ".join(
                    f"{int(length):,}: {rate:.0f}"
                    for length, rate in sorted(
                        m["attention_tflops_by_length"].items(), key=lambda kv: int(kv[0])
                    )
                )
                for name, m in weights.get("measured", {}).items()
            )
            + " (shorter segments run slower per FLOP than the one weight the model has).",
            "",
            *assumption_lines(assumed, weights),
            "",
            *markdown_lines(results)[: len(results) + 2],
            "",
            *summary_lines(results),
        ]
    return lines


def planning_lines(
    seeds: Sequence[int], assumed: Assumptions, weights: Optional[Dict[str, Any]] = None
) -> List[str]:
    """Per planner (told the true cost): the mean simulated step / bound, the planning CPU of a
    step (``time.process_time``, one run each), that CPU over the simulated step in seconds, and
    the mean (step + planning) / bound. The cost model is in microseconds, so the step's seconds
    are known."""
    import statistics
    import time

    lines = [
        "| planner | step / bound, mean (worst) | planning CPU a step, median (max) | planning / "
        "step, median (max) | (step + planning) / bound, mean |",
        "|---|---|---|---|---|",
    ]
    for planner in (DEFAULT_PLANNER, THOROUGH_PLANNER):
        ratios, seconds, shares, totals = [], [], [], []
        for seed in seeds:
            for case in cases(seed):
                cost = true_cost(case, assumed, weights)
                started = time.process_time()
                scored = _told(case, cost, planner)
                spent = time.process_time() - started
                real = sum(cost.cost(n, 0) for n in case.samples.lengths)
                gpus = case.parallel.dp_size * case.parallel.pp_size
                bound_s = real * (1.0 + BACKWARD_TO_FORWARD_RATIO) / gpus / 1e6
                ratios.append(scored["step"])
                seconds.append(spent)
                shares.append(spent / (scored["step"] * bound_s))
                totals.append((scored["step"] * bound_s + spent) / bound_s)
        lines.append(
            f"| {planner} | {statistics.mean(ratios):.4f} ({max(ratios):.3f}) | "
            f"{statistics.median(seconds):.3f} s ({max(seconds):.3f} s) | "
            f"{statistics.median(shares):.1%} ({max(shares):.1%}) | {statistics.mean(totals):.4f} |"
        )
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--weights", default=None, help="JSON of measured rates or per-model weights (see above)"
    )
    parser.add_argument("--seeds", default="0", help="workload seeds, comma separated")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--markdown", action="store_true", help="print the docs' tables")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="print per case the best ramp of divisible work (ramp_floor, not a bound; minutes)",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help="print ours (told) and every peer per case: step / bound (bubble share of the step)",
    )
    parser.add_argument(
        "--planning",
        action="store_true",
        help="only: each of our planners' simulated step, its planning CPU, and the step with "
        "the planning counted in (a step that does not overlap its planning pays it)",
    )
    args = parser.parse_args(argv)
    assumed, weights = _load_weights(args.weights)
    if args.planning:
        seeds = [int(s) for s in args.seeds.split(",")]
        print("\n".join(planning_lines(seeds, assumed, weights)))
        return 0
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for case in cases(seed):
            r = run_case(case, assumed, weights)
            r["case"] = f"{r['case']}" + (f" seed{seed}" if seed else "")
            results.append(r)
    if args.json:
        print(json.dumps({"assumptions": asdict(assumed), "results": results}))
        return 0
    print("\n".join(assumption_lines(assumed, weights)))
    print()
    if args.markdown:
        print("\n".join(markdown_lines(results)))
        print()
    if args.peers:
        print("\n".join(peer_lines(results)))
        print()
    if args.floor:
        floors = []
        for r, case in zip(
            results, [c for seed in args.seeds.split(",") for c in cases(int(seed))], strict=True
        ):
            floor = ramp_floor(case, true_cost(case, assumed, weights))
            floors.append(floor)
            print(
                f"{r['case']}: ours told {r['ours']['told']['step']:.3f}, divisible work's best ramp {floor:.3f}"
            )
        print(f"mean of the divisible work's best ramps: {sum(floors) / len(floors):.3f}")
        print()
    print("\n".join(summary_lines(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
