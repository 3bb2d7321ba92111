"""The peers' real scheduling code, run on our inputs, to diff the baselines against and to time.

Nothing of the peers is shipped or committed: each function here imports (or, where the module
drags in GPU-only dependencies, extracts by name with :mod:`ast` and executes) the upstream
function from a checkout whose root an environment variable names:

=================== ============================================================================
``VERL_SRC``        volcengine/verl: ``verl/utils/seqlen_balancing.py`` (``get_seqlen_balanced_
                    partitions``, ``rearrange_micro_batches``) and the driver's ``_balance_batch``
                    (``verl/trainer/ppo/ray_trainer.py``), on torch tensors as verl runs them
``SLIME_SRC``       THUDM/slime: ``slime.utils.dp_schedule.build_dp_schedule`` (standard library)
``NEMO_RL_SRC``     NVIDIA-NeMo/RL: ``nemo_rl/data/packing/algorithms.py`` packers
``SKYRL_SRC``       NovaSky-AI/SkyRL: ``skyrl/train/dataset/bin_packing.py`` ``Balanced`` packer
``MEGATRON_LM_SRC`` NVIDIA/Megatron-LM: ``DpBalancedScheduler.get_groups_and_subsamples``
=================== ============================================================================

A checkout can be any tree holding those files (``git archive`` of the repository is enough).
The drivers around the upstream functions (chunking a batch over DP ranks, the all-reduce MAX of
micro-batch counts) are restated here from the upstream code, since they live in distributed
workers; each says which lines it restates.

Run ``python -m benchmarks.peers [--cases N]`` to diff every baseline of
:mod:`benchmarks.baselines` against its peer on random steps (schedules must be identical) and to
time verl's whole pipeline at 16,384 samples and dp 512.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import random
import statistics
import sys
import time
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from benchmarks import baselines
from benchmarks.baselines import BaselineFailure
from megatron_dynbatch.errors import DynBatchRuntimeError, DynBatchValueError
from megatron_dynbatch.planning.spec import round_up

__all__ = ["PEERS", "available", "run_peer"]

Ranks = List[List[List[int]]]

#: baseline name -> (environment variable of the checkout, runner name).
PEERS: Dict[str, str] = {
    "verl_kk": "VERL_SRC",
    "slime_first_fit": "SLIME_SRC",
    "nemo_rl_ffd": "NEMO_RL_SRC",
    "nemo_rl_mffd": "NEMO_RL_SRC",
    "skyrl_balanced": "SKYRL_SRC",
    "next_fit": "MEGATRON_LM_SRC",
}


def available(name: str) -> bool:
    """Whether the checkout for baseline ``name`` is given and present."""
    root = os.environ.get(PEERS.get(name, ""), "")
    return bool(root) and os.path.isdir(root)


def _root(variable: str) -> str:
    root = os.environ.get(variable)
    if not root or not os.path.isdir(root):
        raise DynBatchRuntimeError(
            f"set {variable} to the root of a checkout (see benchmarks/peers.py)"
        )
    return root


def _extract(path: str, names: Sequence[str], namespace: Dict[str, Any]) -> Dict[str, Any]:
    """Execute only the named top-level functions (or ``Class.method``) of a source file.

    Used where importing the module would pull in GPU-only packages: the function bodies run
    unchanged, with ``namespace`` standing in for the module's globals.
    """
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), filename=path)
    picked = []
    for name in names:
        owner, _, member = name.rpartition(".")
        for node in tree.body:
            if owner and isinstance(node, ast.ClassDef) and node.name == owner:
                picked += [
                    n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == member
                ]
            elif not owner and isinstance(node, ast.FunctionDef) and node.name == member:
                picked.append(node)
    found = {node.name for node in picked}
    missing = [n for n in names if n.rpartition(".")[2] not in found]
    if missing:
        raise DynBatchRuntimeError(f"{path}: no {missing} (upstream changed?)")
    module = ast.Module(body=picked, type_ignores=[])
    exec(compile(module, path, "exec"), namespace)  # noqa: S102 - the peer's own code
    return namespace


def _load_file(path: str, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------- verl


class _Jagged:
    """Stands in for verl's nested ``input_ids``: ``offsets().diff()`` gives the lengths."""

    is_nested = True

    def __init__(self, lengths: Sequence[int]) -> None:
        import torch

        self._offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)

    def offsets(self):
        return self._offsets


def _verl_namespace() -> Dict[str, Any]:
    import heapq
    from itertools import chain

    import torch
    from torch import distributed as dist

    root = _root("VERL_SRC")
    tensordict_utils = types.SimpleNamespace(
        index_select_tensor_dict=lambda batch, indices: list(indices)
    )
    namespace: Dict[str, Any] = {
        "torch": torch,
        "dist": dist,
        "heapq": heapq,
        "copy": __import__("copy"),
        "chain": chain,
        "tu": tensordict_utils,
        "get_device_name": lambda: "cpu",
        "DataProto": object,
    }
    _extract(
        os.path.join(root, "verl", "utils", "seqlen_balancing.py"),
        [
            "calculate_workload",
            "karmarkar_karp",
            "get_seqlen_balanced_partitions",
            "log_seqlen_unbalance",
            "ceildiv",
            "roundup_divisible",
            "rearrange_micro_batches",
        ],
        namespace,
    )
    trainer: Dict[str, Any] = {
        "torch": torch,
        "calculate_workload": namespace["calculate_workload"],
        "get_seqlen_balanced_partitions": namespace["get_seqlen_balanced_partitions"],
        "log_seqlen_unbalance": namespace["log_seqlen_unbalance"],
    }
    _extract(
        os.path.join(root, "verl", "trainer", "ppo", "ray_trainer.py"),
        ["RayPPOTrainer._balance_batch"],
        trainer,
    )
    namespace["_balance_batch"] = trainer["_balance_batch"]
    return namespace


class _VerlBatch:
    """The slice of ``DataProto`` that ``_balance_batch`` touches: a padded attention mask (built
    lazily from lengths through a stand-in whose ``sum(-1)`` gives them) and ``reorder``."""

    def __init__(self, lengths: Sequence[int]) -> None:
        import torch

        lengths_tensor = torch.tensor(list(lengths), dtype=torch.int64)

        class _Mask:
            shape = (len(lengths), max(lengths))

            def view(self, *_):
                return self

            def sum(self, dim):
                return lengths_tensor

        self.batch = {"attention_mask": _Mask()}
        self.non_tensor_batch: Dict[str, Any] = {}
        self.order: List[int] = []

    def reorder(self, index) -> None:
        self.order = [int(i) for i in index]


def real_verl(
    lengths: Sequence[int], *, dp_size: int, token_cap: int, microbatch_multiple: int = 1
) -> Tuple[Ranks, Dict[str, float]]:
    """verl's schedule, and its CPU time split into the driver and the slowest rank.

    Driver: ``RayPPOTrainer._balance_batch`` (its default branch: equal-size KK over DP on
    ``calculate_workload`` of a tensor, each partition reordered light-heavy-light), then the
    dispatcher's equal chunks. Per rank: ``rearrange_micro_batches`` on the rank's lengths. verl
    all-reduces the micro-batch count with MAX inside it; with no process group that reduces to
    calling it once per rank for the counts and again with ``min_num_micro_batch`` = their max.
    """
    namespace = _verl_namespace()
    n = len(lengths)
    if n % dp_size:
        raise BaselineFailure("verl_kk", f"{n} samples are not a multiple of dp_size={dp_size}")
    if max(lengths) > token_cap:
        raise BaselineFailure("verl_kk", f"max_token_len={token_cap} < longest {max(lengths)}")
    trainer = types.SimpleNamespace(
        _get_dp_size=lambda *_: dp_size, actor_rollout_wg=None, config=None
    )
    batch = _VerlBatch(lengths)
    start = time.process_time()
    namespace["_balance_batch"](trainer, batch, metrics={})
    driver = time.process_time() - start
    chunk = n // dp_size
    rank_samples = [batch.order[r * chunk : (r + 1) * chunk] for r in range(dp_size)]
    divided_by = microbatch_multiple if microbatch_multiple > 1 else None

    def rearrange(samples: List[int], minimum: Optional[int]):
        local = {"input_ids": _Jagged([lengths[i] for i in samples])}
        try:
            return namespace["rearrange_micro_batches"](
                local,
                max_token_len=token_cap,
                num_batches_divided_by=divided_by,
                min_num_micro_batch=minimum,
            )[1]
        except AssertionError as exc:
            raise BaselineFailure("verl_kk", f"upstream assert: {exc}") from None

    counts = [len(rearrange(samples, None)) for samples in rank_samples]
    ranks: Ranks = []
    slowest = 0.0
    for samples in rank_samples:
        start = time.process_time()
        parts = rearrange(samples, max(counts))
        slowest = max(slowest, time.process_time() - start)
        ranks.append([[samples[i] for i in part] for part in parts])
    return ranks, {"driver_s": driver, "slowest_rank_s": slowest}


# --------------------------------------------------------------------------------------- slime


def real_slime(
    lengths: Sequence[int],
    *,
    dp_size: int,
    token_cap: int,
    microbatch_multiple: int = 1,
    rollout_ids: Optional[Sequence[Any]] = None,
) -> Ranks:
    """``build_dp_schedule`` for one step holding every rollout, strided DP distribution."""
    root = _root("SLIME_SRC")
    if root not in sys.path:
        sys.path.insert(0, root)
    dp_schedule = importlib.import_module("slime.utils.dp_schedule")
    ids = list(range(len(lengths))) if rollout_ids is None else list(rollout_ids)
    args = types.SimpleNamespace(
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=token_cap,
        balance_data=False,
        balance_by_flops=False,
        micro_batch_size=None,
    )
    config = {
        "dp_size": dp_size,
        "cp_size": 1,
        "vpp_size": 2 if microbatch_multiple > 1 else 1,
        "microbatch_group_size_per_vp_stage": microbatch_multiple,
    }
    try:
        partitions, micro_batch_indices, _, _ = dp_schedule.build_dp_schedule(
            args,
            config,
            list(lengths),
            global_batch_size=len(dict.fromkeys(ids)),
            rollout_indices=ids,
        )
    except AssertionError as exc:
        raise BaselineFailure("slime_first_fit", f"upstream assert: {exc}") from None
    return [
        [[partitions[r][j] for j in mb] for mb in micro_batch_indices[r]] for r in range(dp_size)
    ]


# ------------------------------------------------------------------------------------- NeMo-RL


def real_nemo_rl(
    lengths: Sequence[int],
    *,
    dp_size: int,
    token_cap: int,
    microbatch_multiple: int = 1,
    algorithm: str = "modified_first_fit_decreasing",
) -> Ranks:
    """The packer with ``min_bin_count = dp``, ``bin_count_multiple = dp * group``, then the
    round-robin shard of ``shard_by_batch_size`` (which first asserts ``batch % dp == 0``)."""
    root = _root("NEMO_RL_SRC")
    algorithms = _load_file(
        os.path.join(root, "nemo_rl", "data", "packing", "algorithms.py"), "_peer_nemo_packing"
    )
    name = "nemo_rl_mffd" if algorithm.startswith("modified") else "nemo_rl_ffd"
    if len(lengths) % dp_size:
        raise BaselineFailure(name, f"batch size {len(lengths)} % shards {dp_size} != 0")
    packer = algorithms.get_packer(
        algorithm,
        bin_capacity=token_cap,
        min_bin_count=dp_size,
        bin_count_multiple=dp_size * microbatch_multiple,
    )
    try:
        bins = packer.pack(list(lengths))
    except ValueError as exc:
        raise BaselineFailure(name, f"upstream ValueError: {exc}") from None
    return [[list(bins[j]) for j in range(r, len(bins), dp_size)] for r in range(dp_size)]


# --------------------------------------------------------------------------------------- SkyRL


def real_skyrl(
    lengths: Sequence[int], *, dp_size: int, token_cap: int, microbatch_multiple: int = 1
) -> Ranks:
    """The real ``Balanced`` packer per rank; the driver (pad with copies of sample 0, equal
    contiguous chunks, MAX of the counts, padding micro-batches) restated from ``dispatch.py`` and
    ``worker_utils.py``."""
    root = _root("SKYRL_SRC")
    packing = _load_file(
        os.path.join(root, "skyrl", "train", "dataset", "bin_packing.py"), "_peer_skyrl_packing"
    )
    every = list(lengths) + [lengths[0]] * ((-len(lengths)) % dp_size)
    chunk = len(every) // dp_size
    ranks: Ranks = []
    for r in range(dp_size):
        base = r * chunk
        bins = packing.make_seq_packer("balanced", bin_capacity=token_cap).pack(
            every[base : base + chunk]
        )
        ranks.append([[base + i for i in b] for b in bins])
    target = max(len(rank) for rank in ranks)
    target = round_up(target, microbatch_multiple)
    for rank in ranks:
        rank.extend([] for _ in range(target - len(rank)))
    return ranks


# --------------------------------------------------------------------------------- Megatron-LM


def real_megatron(
    lengths: Sequence[int], *, dp_size: int, token_cap: int, microbatch_multiple: int = 1
) -> Ranks:
    """``DpBalancedScheduler.get_groups_and_subsamples`` (cp 1) on ``(index, length)`` pairs."""
    root = _root("MEGATRON_LM_SRC")
    namespace = _extract(
        os.path.join(root, "megatron", "core", "datasets", "data_schedule.py"),
        ["DpBalancedScheduler.get_groups_and_subsamples"],
        {},
    )
    scheduler = types.SimpleNamespace(
        max_seq_len_all_ranks=token_cap,
        dp_size=dp_size,
        cp_size=1,
        microbatch_group_size_per_vp_stage=microbatch_multiple if microbatch_multiple > 1 else None,
    )
    try:
        groups = namespace["get_groups_and_subsamples"](
            scheduler, [(i, length) for i, length in enumerate(lengths)]
        )
    except AssertionError as exc:
        raise BaselineFailure("next_fit", f"upstream assert: {exc}") from None
    return [[list(groups[m][r]) for m in range(len(groups))] for r in range(dp_size)]


def run_peer(
    name: str,
    lengths: Sequence[int],
    *,
    dp_size: int,
    token_cap: int,
    microbatch_multiple: int = 1,
    rollout_ids: Optional[Sequence[Any]] = None,
) -> Ranks:
    """The real peer schedule of baseline ``name`` (same arguments as the baseline)."""
    kwargs = dict(dp_size=dp_size, token_cap=token_cap, microbatch_multiple=microbatch_multiple)
    if name == "verl_kk":
        return real_verl(lengths, **kwargs)[0]
    if name == "slime_first_fit":
        return real_slime(lengths, rollout_ids=rollout_ids, **kwargs)
    if name == "nemo_rl_ffd":
        return real_nemo_rl(lengths, algorithm="first_fit_decreasing", **kwargs)
    if name == "nemo_rl_mffd":
        return real_nemo_rl(lengths, **kwargs)
    if name == "skyrl_balanced":
        return real_skyrl(lengths, **kwargs)
    if name == "next_fit":
        return real_megatron(lengths, **kwargs)
    raise DynBatchValueError(f"no peer for {name!r}; peers: {sorted(PEERS)}")


def _outcome(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The schedule as plain lists, or ``"FAIL"`` where the scheduler rejects the input."""
    try:
        return [[list(mb) for mb in rank] for rank in fn(*args, **kwargs)]
    except BaselineFailure:
        return "FAIL"


def diff_cases(num_cases: int, seed: int = 0) -> Dict[str, Dict[str, int]]:
    """Run every available peer and its baseline on random steps; count identical schedules."""
    from benchmarks.search import random_case

    rng = random.Random(seed)
    tally: Dict[str, Dict[str, int]] = {}
    for k in range(num_cases):
        case = random_case(rng, k)
        for name in PEERS:
            if not available(name):
                continue
            kwargs = dict(
                dp_size=case.parallel.dp_size,
                token_cap=case.token_cap,
                microbatch_multiple=case.parallel.microbatch_multiple,
                rollout_ids=case.samples.rollout_ids,
            )
            lengths = case.samples.lengths
            ours = _outcome(baselines.BASELINES[name], lengths, **kwargs)
            theirs = _outcome(run_peer, name, lengths, **kwargs)
            entry = tally.setdefault(name, {"same": 0, "different": 0, "both_fail": 0})
            if ours == "FAIL" and theirs == "FAIL":
                entry["both_fail"] += 1
            elif ours == theirs:
                entry["same"] += 1
            else:
                entry["different"] += 1
                entry.setdefault("first_difference", case.label)
    return tally


def time_verl_pipeline(num_samples: int = 16384, dp_size: int = 512, repeats: int = 3) -> str:
    """CPU time of verl's real pipeline on the long-tailed GRPO mix (driver + slowest rank)."""
    from benchmarks.lengths import grpo_lengths

    ls = grpo_lengths(num_samples // 8, 8, max_len=16384, seed=0)
    totals = []
    for _ in range(repeats):
        _, times = real_verl(ls.lengths, dp_size=dp_size, token_cap=16384)
        totals.append((times["driver_s"], times["slowest_rank_s"]))
    driver = statistics.median(t[0] for t in totals)
    rank = statistics.median(t[1] for t in totals)
    return (
        f"verl real pipeline, {num_samples} samples, dp {dp_size}: driver _balance_batch "
        f"{driver * 1e3:.0f} ms + slowest rank rearrange_micro_batches {rank * 1e3:.1f} ms = "
        f"{(driver + rank) * 1e3:.0f} ms CPU"
    )


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200, help="random steps to diff")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    present = [name for name in PEERS if available(name)]
    if not present:
        print("no peer checkout given; set " + ", ".join(sorted(set(PEERS.values()))))
        return 1
    for name, entry in diff_cases(args.cases, args.seed).items():
        print(f"{name:<16} {entry}")
    if available("verl_kk"):
        print(time_verl_pipeline())
    return 0


if __name__ == "__main__":
    sys.exit(main())
