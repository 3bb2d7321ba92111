"""Benchmark job: a tiny Megatron GPT on RL-like rollouts with and without dynamic batching.

``benchmarks/bench_e2e.py`` runs it under torchrun to time the schedule alone, in one process
group, with a hand-written training loop around megatron.core (no Megatron-LM ``pretrain()``; the
main job, ``launch/demo.sh``, is the ``pretrain()`` path). Every process is one rank of a gloo world
on CPU (NCCL on GPUs). The same steps run twice from the same initial weights on the same rollouts:

1. ``--use-dynamic-batch-size``: the global planner packs each step's GRPO groups into
   micro-batches under ``--max-tokens-per-gpu``, balanced over DP ranks, aligned for the schedule;
2. fixed batching (Megatron's default): ``--micro-batch-size`` rows padded to ``--seq-length``.

Both use the exact token-mean loss, so their loss curves agree to float precision while the
dynamic run computes far fewer padded tokens. Per step it prints loss, tokens/s, micro-batches per
rank, fill, placeholders and DP imbalance; at the end wall time, padded tokens and the two loss
curves side by side.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from importlib import resources

import torch
import torch.distributed as dist

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

# Megatron's notices (no apex / transformer-engine, deprecated GPTModel) repeat per rank and per
# model build and would bury the step lines; errors still show.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
logging.getLogger("megatron").setLevel(logging.ERROR)
apply_cpu_shim()  # no-op where CUDA exists; must precede the first megatron import

from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

from megatron_dynbatch.errors import DynBatchValueError  # noqa: E402
from megatron_dynbatch.integrations.megatron_lm.arguments import (  # noqa: E402
    add_dynamic_batch_args,
    dynbatch_config_from_args,
)
from megatron_dynbatch.mcore.step import (  # noqa: E402
    check_plan_agreement,
    configure_loss,
    train_microbatches,
)
from megatron_dynbatch.planning import ParallelLayout, plan_schedule  # noqa: E402
from megatron_dynbatch.planning.fixed import plan_fixed_microbatches  # noqa: E402
from megatron_dynbatch.runtime import (  # noqa: E402
    BatchSchema,
    finalize_loss,
    materialize_microbatches,
)
from megatron_dynbatch.tools.testing.tiny_gpt import (  # noqa: E402
    TINY_VOCAB_SIZE,
    build_tiny_gpt,
    tiny_transformer_config,
    wrap_in_ddp,
)

VOCAB = TINY_VOCAB_SIZE


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="fixed-batching rows")
    parser.add_argument("--seq-length", type=int, default=256, help="fixed-batching row length")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--data", default=None, help="rollouts JSON (default: bundled set)")
    parser.add_argument(
        "--compare",
        choices=("fixed", "none"),
        default="fixed",
        help="also run fixed batching for comparison (default) or not",
    )
    parser.add_argument("--json-out", default=None, help="write the summary as JSON here")
    add_dynamic_batch_args(parser)
    args = parser.parse_args(argv)
    # The demo's defaults: dynamic batching on, 512-token budget, 8 GRPO groups per step.
    if not args.use_dynamic_batch_size and args.compare == "none":
        parser.error("nothing to run: pass --use-dynamic-batch-size or --compare fixed")
    defaults = {"max_tokens_per_gpu": 512, "rollouts_per_step": 8}
    for dest, value in defaults.items():  # these two flags store under their field names
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    return args


def load_rollouts(path):
    if path is None:
        text = resources.files("megatron_dynbatch").joinpath("data/demo_rollouts.json").read_text()
    else:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    items = json.loads(text)
    lengths = [item["length"] for item in items]
    rollouts = [item["rollout"] for item in items]
    prompts = [item.get("prompt_length", 0) for item in items]
    return lengths, rollouts, prompts


def make_sample(index, length, prompt_length, seed):
    """A learnable RL-like sample: random prompt, response following a fixed bigram rule."""
    generator = torch.Generator().manual_seed(seed * 7_919 + index)
    tokens = torch.randint(1, VOCAB, (length,), generator=generator)
    for k in range(prompt_length, length):
        tokens[k] = (tokens[k - 1] * 5 + 3) % VOCAB
    return {"tokens": tokens, "prompt_length": prompt_length}


def run(mode, args, data, layout, rank0):
    lengths, rollouts, prompts = data
    dp_rank = parallel_state.get_data_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    dyn = dynbatch_config_from_args(args)
    if mode == "dynamic":
        plan = plan_schedule(lengths, rollouts, prompts, config=dyn.planner_config(layout))
    else:
        plan = plan_fixed_microbatches(
            lengths,
            rollouts,
            dp_size=layout.dp_size,
            micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length,
            rollouts_per_step=dyn.rollouts_per_step,
            microbatch_multiple=layout.microbatch_multiple,
        )
    check_plan_agreement(plan)
    config = tiny_transformer_config(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        hidden_size=64,
        num_attention_heads=4,
    )
    model_parallel_cuda_manual_seed(args.seed)
    chunks = wrap_in_ddp(
        build_tiny_gpt(config, max_sequence_length=args.seq_length, seed=args.seed)
    )
    configure_loss(chunks, "token-mean")
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = (
        torch.optim.SGD(params, lr=args.lr)
        if args.optimizer == "sgd"
        else torch.optim.Adam(params, lr=args.lr)
    )
    schema = BatchSchema()
    history = []
    steps = min(args.steps, len(plan.steps))
    for s in range(steps):
        step = plan.steps[s]
        mine = {
            i: make_sample(i, lengths[i], prompts[i], args.seed)
            for mb in step.rank_microbatches(dp_rank)
            for i in mb
        }
        microbatches = materialize_microbatches(
            step, dp_rank, mine, schema, layout=plan.layout, sample_multiple=plan.sample_multiple
        )
        dist.barrier()
        started = time.perf_counter()
        for chunk in chunks:
            chunk.zero_grad_buffer()
        logs = train_microbatches(chunks, step, microbatches, aggregation="token-mean")
        for p in params:
            p.grad = p.main_grad
        optimizer.step()
        # Megatron DDP's backward hook adds param.grad into main_grad: a .grad left aliasing the
        # buffer would be accumulated into and added again, doubling the next step's first
        # micro-batch. Megatron's own optimizers never leave it set; neither may we.
        for p in params:
            p.grad = None
        dist.barrier()
        seconds = time.perf_counter() - started
        sums = torch.tensor(
            [sum(float(e["loss"][0]) for e in logs), sum(float(e["loss"][1]) for e in logs)],
            dtype=torch.float64,
        )
        dist.all_reduce(sums)  # only last-stage ranks logged; DP ranks hold their shares
        loss = float(finalize_loss("token-mean", sums[0], sums[1]))
        computed = layout.dp_size * step.num_microbatches * step.micro_batch_size * step.seq_length
        record = {
            "step": s + 1,
            "loss": loss,
            "seconds": seconds,
            "real_tokens": step.real_tokens,
            "computed_tokens": computed,
            "tokens_per_s": step.real_tokens / seconds,
            "num_microbatches": step.num_microbatches,
            "shape": [step.micro_batch_size, step.seq_length],
            "fill": step.fill,
            "placeholders": step.num_placeholders,
            "dp_imbalance": step.dp_imbalance,
        }
        history.append(record)
        if rank0:
            print(
                f"[{mode:>7}] step {s + 1:>2}/{steps} | loss {loss:.4f} | "
                f"tokens/s {record['tokens_per_s']:>8.0f} | mb/rank {step.num_microbatches:>2} "
                f"[{step.micro_batch_size}x{step.seq_length}] | fill {step.fill:.2f} | "
                f"placeholders {step.num_placeholders} | dp_imb {step.dp_imbalance:.3f} | "
                f"{seconds:.2f} s",
                flush=True,
            )
    return history


def summarize(results):
    lines = []
    modes = list(results)
    totals = {
        m: {
            "wall_s": sum(r["seconds"] for r in h),
            "real": sum(r["real_tokens"] for r in h),
            "computed": sum(r["computed_tokens"] for r in h),
        }
        for m, h in results.items()
    }
    header = f"{'':24}" + "".join(f"{m:>14}" for m in modes)
    lines.append(header)
    rows = [
        ("train wall time (s)", lambda t: f"{t['wall_s']:.2f}"),
        ("tokens/s (real)", lambda t: f"{t['real'] / t['wall_s']:.0f}"),
        ("computed tokens", lambda t: f"{t['computed']}"),
        ("padded tokens", lambda t: f"{t['computed'] - t['real']}"),
        ("fill", lambda t: f"{t['real'] / t['computed']:.3f}"),
    ]
    for name, fmt in rows:
        lines.append(f"{name:24}" + "".join(f"{fmt(totals[m]):>14}" for m in modes))
    if "dynamic" in totals and "fixed" in totals:
        ratio = totals["dynamic"]["wall_s"] / totals["fixed"]["wall_s"]
        lines.append(f"dynamic / fixed wall time: {ratio:.2f}x")
    lines.append("")
    lines.append("loss curves:  step" + "".join(f"{m:>12}" for m in modes))
    for k in range(max(len(h) for h in results.values())):
        cells = "".join(
            f"{results[m][k]['loss']:>12.5f}" if k < len(results[m]) else f"{'':>12}" for m in modes
        )
        lines.append(f"              {k + 1:>4}{cells}")
    return "\n".join(lines), totals


def main(argv=None):
    args = parse_args(argv)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    pp = args.pipeline_model_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size
    if dist.get_world_size() % pp:
        raise DynBatchValueError(
            f"world size {dist.get_world_size()} is not a multiple of "
            f"--pipeline-model-parallel-size {pp}; change --nproc-per-node."
        )
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp
    )
    layout = ParallelLayout(
        dp_size=parallel_state.get_data_parallel_world_size(), pp_size=pp, vpp_size=vpp or 1
    )
    rank0 = dist.get_rank() == 0
    data = load_rollouts(args.data)
    if rank0:
        print(
            f"megatron_dynbatch demo: {len(data[0])} samples, world {dist.get_world_size()} "
            f"(dp={layout.dp_size} pp={pp} vpp={vpp or 1}), {dist.get_backend()}, "
            f"max_tokens_per_gpu={args.max_tokens_per_gpu}, rollouts/step={args.rollouts_per_step}",
            flush=True,
        )
    results = {}
    if args.use_dynamic_batch_size:
        results["dynamic"] = run("dynamic", args, data, layout, rank0)
    if args.compare == "fixed":
        results["fixed"] = run("fixed", args, data, layout, rank0)
    if rank0:
        text, totals = summarize(results)
        print("\n" + text, flush=True)
        if args.json_out:
            with open(args.json_out, "w", encoding="utf-8") as handle:
                json.dump({"runs": results, "totals": totals}, handle, indent=1)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
