"""Helpers shared by several test modules (not a test module: pytest collects nothing here).

Test modules import from here, never from each other, so moving or deselecting one test module
cannot break another.
"""

import contextlib
import dataclasses
import importlib.util
import os
import pathlib
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import types
import typing
from functools import partial

import pytest
import torch

from megatron_dynbatch.planning.plan import StepPlan

#: The repository root (tests read its files; they never write into it).
REPO = pathlib.Path(__file__).resolve().parents[1]

#: A failure that must reach every rank "within seconds" must come this fast. Measured well under a
#: second on an idle machine; the margin absorbs a loaded CI machine (2 cores shared by several
#: jobs) while staying far below the hang it rules out: the worker pool's process-group timeout
#: (``tools.testing.workers.DEFAULT_TIMEOUT_S``, 180 s). Speed itself is measured by benchmarks.
FAIL_FAST_S = 30.0

#: Workers must be gone this soon after their parent died (parent-death signal: at once; the
#: watchdog thread: within its 0.5 s poll; the rest is margin for a loaded machine).
WORKER_EXIT_WITHIN_S = 10.0
#: How long a parent process may take to start its pool of workers.
WORKER_START_TIMEOUT_S = 120.0

# -- hand-made step plans (runtime tests) ------------------------------------------------------

#: A neutral value per field type (fields with a default keep it).
_NEUTRAL = {int: 0, float: 0.0, tuple: ()}


#: The later steps of the planner's shape choice (planning/shape.py), each as it is when switched
#: off: its input passes through unchanged.
_SHAPE_STEPS_OFF = {
    "_refined": lambda problem, shape: shape,
    "tent_splits": lambda *args: None,
    "_less_rounding": lambda problem, search, shape: shape,
    "_reordered": lambda problem, search, shapes: shapes[0],
    "_decreasing": lambda problem, searches, chosen: chosen,
}


@contextlib.contextmanager
def planner_without(*steps):
    """The planner with ``steps`` (names of :data:`_SHAPE_STEPS_OFF`) switched off: what a test
    compares a step of the shape choice against. A step applied to the choice after the one
    under test is switched off too where the test says so (it would start from another choice)."""
    from unittest import mock

    from megatron_dynbatch.planning import shape

    with contextlib.ExitStack() as stack:
        for name in steps:
            stack.enter_context(mock.patch.object(shape, name, _SHAPE_STEPS_OFF[name]))
        yield


def assert_never_slower(lengths, config, before, tolerance=1e-9):
    """``config``'s plan of ``lengths`` (one step) is check_plan-clean and its replayed step no
    slower, within ``tolerance``, than the plan made under ``before()`` (a context that switches
    a step of the planner off); returns the plan."""
    from megatron_dynbatch.planning import SampleSet, check_plan, plan_schedule

    new = plan_schedule(lengths, config=config)
    with before():
        old = plan_schedule(lengths, config=config)
    check_plan(new, SampleSet.build(lengths), config)
    assert replayed_step_time(new.steps[0], lengths, config) <= replayed_step_time(
        old.steps[0], lengths, config
    ) * (1 + tolerance)
    return new


def own_rows_config(dp, pp, vpp, overhead, thorough, cap=1024, multiple=64):
    """A planner config of rows of their own length (rounded to ``multiple``) under ``cap``, the
    benchmark's cost with a per-micro-batch overhead of ``overhead`` of a full row, and the
    thorough planner where ``thorough``: what the never-slower properties plan."""
    from benchmarks.small_steps import overhead_cost
    from megatron_dynbatch.planning import ParallelLayout, PlannerConfig

    return PlannerConfig(
        max_tokens_per_gpu=cap,
        parallel=ParallelLayout(dp_size=dp, pp_size=pp, vpp_size=vpp),
        cost=overhead_cost(cap, overhead),
        variable_row_lengths=True,
        row_multiple=multiple,
        planner="dynbatch-thorough" if thorough else "dynbatch",
    )


def replayed_step_time(step, lengths, config):
    """A planned step as it runs, replayed on its own rows by the simulator (independent of the
    planner's scoring): the slowest DP rank's pipeline, packed rows of one sample per segment."""
    from megatron_dynbatch.planning.cost import microbatch_cost
    from megatron_dynbatch.planning.simulate import simulate_step

    ranks = []
    for r, rank in enumerate(step.ranks):
        costs = []
        for m, mb in enumerate(rank):
            sizes = [lengths[i] for i in mb]
            row = step.row_lengths[r][m] if step.row_lengths else step.seq_length
            costs.append(microbatch_cost(config.cost, "packed", row, 1, sizes, [0] * len(sizes)))
        ranks.append(costs)
    parallel = config.parallel
    return simulate_step(ranks, parallel.pp_size, parallel.vpp_size).step_time


def make_step_plan(ranks, *, seq_length, micro_batch_size):
    """A StepPlan with the given schedule; the planner's statistics fields get neutral values."""
    values = dict(
        num_microbatches=len(ranks[0]),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        ranks=tuple(tuple(tuple(mb) for mb in rank) for rank in ranks),
    )
    types = typing.get_type_hints(StepPlan)
    for f in dataclasses.fields(StepPlan):
        if f.name in values or f.default is not dataclasses.MISSING:
            continue
        kind = typing.get_origin(types[f.name]) or types[f.name]
        values[f.name] = _NEUTRAL[kind]
    return StepPlan(**values)


# -- slime's arguments (the slime schedule tests) --------------------------------------------------


#: A tiny dense model's Megatron arguments, as slime's args carry them.
TINY_SLIME_MODEL = dict(
    hidden_size=16,
    num_attention_heads=2,
    num_query_groups=2,
    vocab_size=32,
    ffn_hidden_size=64,
    num_experts=None,
    num_layers=2,
    kv_channels=8,
)


def slime_args(**overrides):
    """The slime arguments ``build_dp_schedule`` reads (a tiny dense model), with overrides."""
    values = dict(
        micro_batch_size=1,
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=32768,
        balance_data=False,
        balance_by_flops=False,
        **TINY_SLIME_MODEL,
    )
    values.update(overrides)
    return types.SimpleNamespace(**values)


#: Modules slime imports for rollout serving and logging, stubbed when they are not installed.
SLIME_STUBBED = (
    "ray",
    "sglang",
    "sglang_router",
    "requests",
    "torch_memory_saver",
    "wandb",
    "httpx",
    "tensorboard",
)


def megatron_lm_args(argv, **validated):
    """Parse ``argv`` with our Megatron-LM flags, then set what Megatron's ``validate_args``
    would have derived (dp 2, no model parallelism; ``validated`` overrides)."""
    import argparse

    from megatron_dynbatch.integrations.megatron_lm.arguments import add_dynamic_batch_args

    parser = add_dynamic_batch_args(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(argv)
    base = dict(
        data_parallel_size=2,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1,
        calculate_per_token_loss=True,
        rampup_batch_size=None,
        decrease_batch_size_if_needed=False,
        iterations_to_skip=[],
        perform_rl_step=False,
        hybrid_context_parallel=False,
        gtp_weight_remat_size=1,
        variable_seq_lengths=False,
    )
    base.update(validated)
    for key, value in base.items():
        setattr(args, key, value)
    return args


def slime_tp(dp_size=1, cp_size=1, vpp_size=1, microbatch_group_size_per_vp_stage=1) -> dict:
    """The parallel sizes slime passes ``build_dp_schedule`` (its ``tp`` dict, slime's key names)."""
    return {
        "dp_size": dp_size,
        "cp_size": cp_size,
        "vpp_size": vpp_size,
        "microbatch_group_size_per_vp_stage": microbatch_group_size_per_vp_stage,
    }


# -- worker processes seen from outside (/proc) --------------------------------------------------


def worker_pids(parent_pid: int) -> dict:
    """pid -> /proc comm of the live (not zombie) worker processes whose parent is parent_pid."""
    from megatron_dynbatch.tools.testing.workers import WORKER_NAME_PREFIX

    found = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if comm.startswith(WORKER_NAME_PREFIX) and int(fields["PPid"]) == parent_pid:
            found[int(entry.name)] = comm
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by PID 1, does not)."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def wait_for_workers(parent: subprocess.Popen, count: int, stderr_path) -> dict:
    """Wait until ``parent`` has ``count`` live workers and every one printed ``running``.

    ``parent.stdout`` must be a binary pipe: it is read with a deadline, never blocking.
    """
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    output = b""
    fd = parent.stdout.fileno()
    while output.count(b"running") < count:
        remaining = deadline - time.monotonic()
        ready = select.select([fd], [], [], max(0.0, remaining))[0] if remaining > 0 else []
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            stderr = pathlib.Path(stderr_path).read_text()[-3000:]
            raise AssertionError(
                f"{output.count(b'running')} of {count} workers running after "
                f"{WORKER_START_TIMEOUT_S - remaining:.0f} s (parent exit code {parent.poll()}):"
                f"\n{stderr}"
            )
        output += chunk
    workers = worker_pids(parent.pid)
    assert len(workers) == count, workers
    return workers


def seconds_until_gone(pids, timeout_s: float = WORKER_EXIT_WITHIN_S) -> float:
    """Seconds until every pid in ``pids`` is gone; kills and fails after ``timeout_s``."""
    started = time.monotonic()
    while any(alive(pid) for pid in pids):
        if time.monotonic() - started > timeout_s:
            left = [pid for pid in pids if alive(pid)]
            for pid in left:  # do not leave them behind for the rest of the suite
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"workers {left} outlived their parent by {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - started


# -- commands as a user types them (README blocks, scripts) --------------------------------------


def readme_block(name: str) -> str:
    """The ```bash block under ``<!-- tested: NAME ... -->`` in README.md."""
    text = (REPO / "README.md").read_text()
    match = re.search(rf"<!-- tested: {name} .*?-->\n```bash\n(.*?)```", text, flags=re.S)
    assert match, f"README block {name!r} not found"
    return match.group(1)


def command_env(extra=None) -> dict:
    """The environment of a command a user types.

    This interpreter's scripts (``torchrun``) come first on PATH, and this checkout is importable,
    so ``python -m megatron_dynbatch...`` works from any working directory.
    """
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def run_shell(command: str, cwd, log_path, *, env=None, timeout_s: float = 600) -> str:
    """Run ``command`` under ``bash -euo pipefail`` in ``cwd``; its output goes to ``log_path``."""
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", command],
        cwd=cwd,
        env=command_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
    )
    log_path.write_text(result.stdout)
    assert result.returncode == 0, result.stdout[-6000:]
    return result.stdout


# -- torchrun launches of the Megatron-LM entry script (test_pretrain and its neighbours) -----

LAUNCH = REPO / "launch" / "pretrain_gpt_dynbatch.py"
BIN = pathlib.Path(sys.executable).parent
TORCHRUN_TIMEOUT_S = 400


def _load_compare():
    spec = importlib.util.spec_from_file_location(
        "compare_runs", REPO / "launch" / "compare_runs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compare_runs = _load_compare()


def torchrun(nproc, script, args, *, env=None, log_path):
    """Run ``torchrun --standalone --nproc-per-node nproc script args``; return (rc, log, seconds).

    A launch still running after :data:`TORCHRUN_TIMEOUT_S` fails the test with every process's
    Python stacks at the end of its log (see :func:`_stacks_and_kill`): a hang shows where it hung.
    """
    command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc), str(script)]
    started = time.monotonic()
    with subprocess.Popen(
        command + [str(a) for a in args],
        cwd=REPO,
        # faulthandler: SIGABRT then prints each thread's Python stack before the process dies.
        env=command_env({"PYTHONFAULTHANDLER": "1", **(env or {})}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        try:
            log, _ = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log = _stacks_and_kill(proc)
            log_path.write_text(log)
            pytest.fail(
                f"torchrun ran past {TORCHRUN_TIMEOUT_S} s; every process's Python stacks "
                f"(faulthandler) end its log:\n{log[-12000:]}"
            )
    log_path.write_text(log)
    return proc.returncode, log, time.monotonic() - started


def _stacks_and_kill(proc) -> str:
    """Abort a hung launch so that each process prints its stacks; return what it printed.

    torchrun starts each rank in a session of its own, so the ranks are found as the agent's
    descendants rather than by process group. Whatever is still alive after that is killed.
    """
    import psutil

    agent = psutil.Process(proc.pid)
    ranks = agent.children(recursive=True)
    # The agent is paused meanwhile (it would stop the other ranks, silently, when the first dies),
    # and the ranks abort one at a time so that their stacks do not interleave.
    steps = [(agent, signal.SIGSTOP)] + [(rank, signal.SIGABRT) for rank in ranks]
    steps += [(agent, signal.SIGCONT), (agent, signal.SIGABRT)]
    for process, signum in steps:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signum)
        time.sleep(1.0)
    try:
        log, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        for process in ranks + [agent]:
            with contextlib.suppress(psutil.Error):
                process.kill()
        log, _ = proc.communicate()
    return log


#: A Hugging Face ``config.json``'s model fields of a Qwen2-style 0.5B-class dense model, and the
#: fields that make it a small MoE: the hosts' memory budgets at config time read them.
QWEN2_05B_HF = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
}
SMALL_MOE_HF = {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 512}


#: Independent launches of one fixture run this many at a time. A launch keeps the 2 cores busy
#: only about half its time (torchrun's agent starts alone, ranks wait on each other in the
#: pipeline): two at once fill the gaps. Each launch still gets its own free port and log.
LAUNCHES_AT_ONCE = 2


def side_by_side(calls):
    """Call each of ``calls`` (no arguments), :data:`LAUNCHES_AT_ONCE` at a time; results in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=LAUNCHES_AT_ONCE) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def torchrun_chains(chains):
    """Run chains of launches side by side (:func:`side_by_side`), each chain in order.

    Args:
        chains: ``{name: [launch, ...]}``; a launch is a tuple of :func:`torchrun`'s arguments
            with its keywords last.

    Returns:
        ``{name: [(rc, log, seconds), ...]}`` in each chain's order.
    """

    def run(chain):
        return [torchrun(*args, **kwargs) for *args, kwargs in chain]

    results = side_by_side([partial(run, chain) for chain in chains.values()])
    return dict(zip(chains, results, strict=True))


def parse_ok(rc, log):
    assert rc == 0, log[-6000:]
    return compare_runs.parse_text(log)


def assert_same_training(dynamic, fixed, *, tolerance=1e-5):
    """Loss within ``tolerance`` (relative) and identical learning rate at every iteration."""
    iterations = sorted(fixed["iterations"])
    assert sorted(dynamic["iterations"]) == iterations and iterations
    for i in iterations:
        d, f = dynamic["iterations"][i], fixed["iterations"][i]
        assert d["lr"] == f["lr"], (i, d, f)
        assert d["loss"] == pytest.approx(f["loss"], rel=tolerance), (i, d, f)
        assert d["batch"] == f["batch"]
        assert "real" in d and "real" not in f  # the dynamic line carries the plan (patch 0003)
    assert [i for i, _ in dynamic["validation"]] == [i for i, _ in fixed["validation"]]
    for (_, d), (_, f) in zip(dynamic["validation"], fixed["validation"], strict=True):
        assert d == pytest.approx(f, rel=tolerance)


# -- MoE routers seen from inside Megatron (the slime and SkyRL MoE cases) ----------------------


#: The tiny MoE of the trainers' router tests: 4 layers, 4 experts, top-2.
TINY_MOE = {"num_layers": 4, "num_moe_experts": 4, "moe_router_topk": 2}


class RouterTokens:
    """Per router layer, the tokens a training forward hands to Megatron's router statistics:
    those its ``padding_mask`` leaves in (every token when no mask reaches the router).
    Observes ``TopKRouter.routing`` (the result is Megatron's own) while ``active``."""

    def __init__(self):
        self.per_layer = {}
        self.active = False

    @contextlib.contextmanager
    def installed(self):
        from megatron.core.transformer.moe.router import TopKRouter

        original = TopKRouter.routing
        observer = self

        def routing(router, logits, padding_mask=None):
            if observer.active and torch.is_grad_enabled():
                num = logits.shape[0] * logits.shape[1]
                real = num if padding_mask is None else int((~padding_mask).sum())
                layer = router.layer_number
                observer.per_layer[layer] = observer.per_layer.get(layer, 0) + real
            return original(router, logits, padding_mask=padding_mask)

        TopKRouter.routing = routing
        try:
            yield self
        finally:
            TopKRouter.routing = original


# -- trainer checkouts with and without our patches (the slime, SkyRL and verl tests) ------------


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (norms; a zero ``b`` counts as tiny, not as a division by zero)."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def host_patches(host: str) -> list:
    """Our patch series for ``host`` (``slime``, ``skyrl``, ``verl``), in the order they apply."""
    return sorted((REPO / "patches" / host).glob("*.patch"))


def unpatch(root, host: str) -> int:
    """Reverse, last first, every patch of ours that ``root`` holds (a checkout patched by
    ``launch/apply_<host>_patches.sh``, wholly or by an older series' prefix); return how many."""
    undone = 0
    for patch in reversed(host_patches(host)):
        command = ["patch", "-d", str(root), "-p1", "-R", "-F0", "--force", "--silent"]
        dry = subprocess.run([*command, "--dry-run"], stdin=patch.open(), capture_output=True)
        if dry.returncode == 0:
            subprocess.run(command, stdin=patch.open(), check=True, capture_output=True)
            undone += 1
    return undone


def stock_copy(checkout, host: str, root: pathlib.Path) -> str:
    """A pristine copy of the checkout's ``<host>/`` package in ``root``, whether the checkout is
    pristine or already patched (the patches are reverse-applied on the copy; the checkout itself
    is never changed)."""
    shutil.copytree(
        pathlib.Path(checkout) / host,
        root / host,
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.orig", "*.rej"),
    )
    undone = unpatch(root, host)
    print(f"\n[{host}] {checkout}: {undone} of our patches reverse-applied on the copy")
    return str(root)


def patched_copy(source, host: str, root: pathlib.Path, *, all_new: bool = True) -> str:
    """A copy of ``source``'s ``<host>/`` package in ``root`` with our patches applied by
    ``launch/apply_<host>_patches.sh``; ``all_new``: every patch must apply (``source`` is stock).
    """
    shutil.copytree(pathlib.Path(source) / host, root / host)
    apply = REPO / "launch" / f"apply_{host}_patches.sh"
    result = subprocess.run(["bash", str(apply), str(root)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    if all_new:
        assert result.stdout.count("applied") == len(host_patches(host)), result.stdout
    return str(root)
