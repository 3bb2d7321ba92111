"""What exchanging shapes costs: megatron.core's p2p with and without ``variable_seq_lengths``.

With ``variable_seq_lengths`` (slime always; Megatron-LM with ``--variable-seq-lengths``) every
pipeline send is preceded by a send of the tensor's shape, so each micro-batch pays one more
round trip per stage boundary and direction. This runs megatron.core's own ``P2PCommunicator`` on
two gloo processes (one stage boundary), sending activations ``[S, 1, hidden]`` forward and their
gradients back, ``--microbatches`` times per trial, with the flag off and on, alternating trials,
and prints the median time per micro-batch of each and their difference: the shape exchange's
cost per micro-batch, in the units the planner's ``cost_shape_exchange_overhead`` takes when
divided by the time of one token's work (calibration folds it into the per-micro-batch fixed
cost it fits from the run's own timers).

Run: ``.venv/bin/python -m benchmarks.bench_shape_exchange [--seq 1024] [--hidden 64]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _trial(communicator, rank: int, shape, microbatches: int) -> float:
    first = rank == 0
    activation = torch.randn(shape)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(microbatches):
        if first:
            communicator.send_forward(activation, is_last_stage=False)
            communicator.recv_backward(shape, is_last_stage=False)
        else:
            received = communicator.recv_forward(shape, is_first_stage=False)
            communicator.send_backward(received, is_first_stage=False)
    dist.barrier()
    return (time.perf_counter() - start) / microbatches


def _worker(rank: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

    apply_cpu_shim()  # before megatron.core imports: no triton, no CUDA here
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    shape = (args.seq, 1, args.hidden)
    times = {False: [], True: []}
    for trial in range(2 * args.trials):
        variable = bool(trial % 2)
        config = ModelParallelConfig(
            pipeline_model_parallel_size=2,
            variable_seq_lengths=variable,
            pipeline_dtype=torch.float32,
            batch_p2p_comm=False,
        )
        communicator = P2PCommunicator(pp_group=dist.group.WORLD, config=config)
        times[variable].append(_trial(communicator, rank, shape, args.microbatches))
    if rank == 0:
        results.update({key: list(value) for key, value in times.items()})
    dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=1024, help="tokens per micro-batch row")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=200)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args(argv)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(_free_port(), args, results), nprocs=2, join=True)
        fixed = statistics.median(results[False])
        exchanged = statistics.median(results[True])
    print(
        f"one stage boundary on gloo, [{args.seq} x 1 x {args.hidden}] fp32 forward and back, "
        f"{args.microbatches} micro-batches x {args.trials} trials each; load {os.getloadavg()}"
    )
    print(f"  uniform shapes (variable_seq_lengths off): {fixed * 1e6:8.1f} us per micro-batch")
    print(
        f"  shapes exchanged (variable_seq_lengths on): {exchanged * 1e6:8.1f} us per micro-batch"
    )
    print(f"  shape exchange: {(exchanged - fixed) * 1e6:+.1f} us per micro-batch and boundary")
    return 0


if __name__ == "__main__":
    sys.exit(main())
