"""Patches to megatron/training 0.19.2: they apply, keep the flag-off path stock, drive real steps.

What runs, on real Megatron code (no mocked schedule, model, optimizer or argument parser):

* ``launch/apply_patches.sh`` on a copy of the installed ``megatron`` package: applies all patches,
  is idempotent, and changes nothing when one patch does not apply.
* In a subprocess with the patched copy first on ``sys.path``: the patched
  ``parse_and_validate_args`` (patch 0001) with our ``extra_args_provider``, then the patched
  ``train_step`` (patch 0002) with a tiny GPTModel, Megatron DDP, Megatron's SGD optimizer and LR
  scheduler and ``get_forward_backward_func()``: flag off it must give bit-identical loss,
  parameters and scheduler state to the stock ``train_step`` (run in a second subprocess on the
  installed tree); flag on it takes one rollout batch of three steps (``--rollouts-per-step`` =
  ``--global-batch-size`` = 2 rollouts), serves the planned steps from it with per-step micro-batch
  counts and row lengths, reports the token-mean loss of exactly the step's samples, and advances
  the LR schedule by ``--global-batch-size`` per step, as stock Megatron does.
* On 2 gloo ranks: ``prepare_train_step`` splits one global batch over the DP ranks; ranks whose
  iterators disagree all raise ``PlanMismatchError``, and a batch of the wrong size on one rank
  stops every rank with the same error, instead of hanging.

Patches 0003 (``training_log``) and 0004 (``evaluate``) run inside Megatron's full ``pretrain()``
in ``test_pretrain.py``, as do pipeline and interleaved layouts.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gloo

REPO = pathlib.Path(__file__).resolve().parents[2]
PATCHES = sorted((REPO / "patches").glob("*.patch"))
APPLY = REPO / "launch" / "apply_patches.sh"
_SUBPROCESS_TIMEOUT_S = 300


def _installed_megatron_root() -> pathlib.Path:
    """The site-packages directory holding the installed ``megatron`` package (not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    assert spec is not None and spec.submodule_search_locations, "megatron-core is not installed"
    return pathlib.Path(list(spec.submodule_search_locations)[0]).parent


STOCK_ROOT = _installed_megatron_root()


def _copy_megatron(destination: pathlib.Path) -> pathlib.Path:
    shutil.copytree(
        STOCK_ROOT / "megatron",
        destination / "megatron",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    return destination


def _apply(tree: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(APPLY), str(tree)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory) -> pathlib.Path:
    tree = _copy_megatron(tmp_path_factory.mktemp("patched"))
    result = _apply(tree)
    assert result.returncode == 0, result.stderr
    assert [line.split()[1] for line in result.stdout.splitlines()] == [p.name for p in PATCHES]
    return tree


# --- the patch files and the apply script -----------------------------------------------------


def test_every_patch_has_a_readme_line_naming_the_version():
    readme = (REPO / "patches" / "README.md").read_text()
    assert PATCHES, "no patches"
    for patch in PATCHES:
        line = next((text for text in readme.splitlines() if patch.name in text), None)
        assert line is not None, f"{patch.name} has no README line"
    assert "0.19.2" in readme


def test_patches_call_our_code_only_behind_the_flag():
    """Every hunk that imports megatron_dynbatch guards it with ``use_dynamic_batch_size``.

    0001 (argument checks) with the flag's presence, the others with its value."""
    for patch in PATCHES:
        hunks = re.split(r"^@@.*@@.*$", patch.read_text(), flags=re.M)[1:]
        for hunk in hunks:
            added = [line[1:] for line in hunk.splitlines() if line.startswith("+")]
            if any("megatron_dynbatch" in line and "import" in line for line in added):
                # 0001 runs whenever our flags are registered: it refuses them without the flag.
                guards = ['getattr(args, "use_dynamic_batch_size", False)']
                if patch.name.startswith("0001"):
                    guards = ['hasattr(args, "use_dynamic_batch_size")']
                assert any(guard in line for guard in guards for line in added), (
                    patch.name,
                    hunk,
                )


def test_apply_is_idempotent(patched_tree):
    result = _apply(patched_tree)
    assert result.returncode == 0 and "already applied" in result.stdout


def test_apply_changes_nothing_when_a_patch_does_not_apply(tmp_path):
    for name in ("training.py", "arguments.py"):
        (tmp_path / "megatron" / "training").mkdir(parents=True, exist_ok=True)
        shutil.copy(STOCK_ROOT / "megatron" / "training" / name, tmp_path / "megatron" / "training")
    training = tmp_path / "megatron" / "training" / "training.py"
    # A user tree where train_step's call differs from 0.19.2: patch 0002 cannot apply.
    call = "            num_microbatches=get_num_microbatches(),\n"
    assert call in training.read_text()
    text = training.read_text().replace(call, call.rstrip("\n") + "  # local change\n")
    training.write_text(text)
    before = {p.name: p.read_bytes() for p in (tmp_path / "megatron" / "training").iterdir()}
    result = _apply(tmp_path)
    assert result.returncode == 1
    assert "0002-train-step-dynamic-microbatches.patch does not apply" in result.stderr
    assert "nothing was changed" in result.stderr
    after = {p.name: p.read_bytes() for p in (tmp_path / "megatron" / "training").iterdir()}
    assert after == before  # patch 0001 was not applied either; no .orig / .rej left behind


def test_apply_rejects_a_directory_without_megatron(tmp_path):
    result = _apply(tmp_path)
    assert result.returncode == 1 and "megatron/training does not exist" in result.stderr


# --- how the launch script gets a patched tree (megatron_dynbatch.integrations.megatron_lm.patched_tree) ----------

_USE_PATCHED = (
    "import pathlib, sys\n"
    "from megatron_dynbatch.integrations.megatron_lm.patched_tree import use_patched_training\n"
    "print(use_patched_training(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]),\n"
    "                           cache_dir=pathlib.Path(sys.argv[3])))\n"
)


def _use_patched(cache: pathlib.Path, first_on_path: pathlib.Path = None):
    path = [str(first_on_path)] if first_on_path else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path + [str(REPO)]))
    return subprocess.run(
        [sys.executable, "-c", _USE_PATCHED, str(REPO / "patches"), str(APPLY), str(cache)],
        capture_output=True,
        text=True,
        env=env,
    )


def test_launch_script_imports_a_patched_copy_and_leaves_the_installed_tree_alone(tmp_path):
    from megatron_dynbatch.integrations.megatron_lm.patched_tree import is_patched

    installed = STOCK_ROOT / "megatron" / "training" / "training.py"
    before = installed.read_bytes()
    first, second = _use_patched(tmp_path), _use_patched(tmp_path)
    assert first.returncode == 0, first.stderr
    copy = pathlib.Path(first.stdout.strip())
    assert copy.parent.parent.parent == tmp_path and is_patched(copy)
    assert second.stdout == first.stdout  # the cached copy is reused
    assert installed.read_bytes() == before and not is_patched(installed.parent)


def _stale_or_missing_bytecode(copy: pathlib.Path):
    """The copy's modules without bytecode Python would load, or whose bytecode names another path."""
    import importlib.util
    import marshal

    bad = []
    for source in sorted(copy.rglob("*.py")):
        cached = pathlib.Path(importlib.util.cache_from_source(str(source)))
        if not cached.is_file():
            bad.append(f"{source.name}: none")
            continue
        data = cached.read_bytes()
        stat = source.stat()
        # Header: magic, flags (0: checked by timestamp), source mtime, source size.
        fresh = int.from_bytes(data[8:12], "little") == int(stat.st_mtime) & 0xFFFFFFFF
        if not fresh or int.from_bytes(data[12:16], "little") != stat.st_size & 0xFFFFFFFF:
            bad.append(f"{source.name}: stale")
        elif marshal.loads(data[16:]).co_filename != str(source):
            bad.append(f"{source.name}: names {marshal.loads(data[16:]).co_filename}")
    return bad


def test_the_patched_copy_holds_its_bytecode(tmp_path, monkeypatch):
    # Where Python writes no bytecode itself, every rank of every launch compiled the copy again.
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    result = _use_patched(tmp_path)
    assert result.returncode == 0, result.stderr
    copy = pathlib.Path(result.stdout.strip())
    assert _stale_or_missing_bytecode(copy) == []
    # A copy made before copies were compiled gets its bytecode on its next use.
    for cache in copy.rglob("__pycache__"):
        shutil.rmtree(cache)
    again = _use_patched(tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout == result.stdout
    assert _stale_or_missing_bytecode(copy) == []


def test_an_already_patched_checkout_is_used_as_is(patched_tree, tmp_path):
    result = _use_patched(tmp_path, first_on_path=patched_tree)
    assert result.returncode == 0, result.stderr
    assert pathlib.Path(result.stdout.strip()) == patched_tree / "megatron" / "training"
    assert not list(tmp_path.iterdir())


def test_another_megatron_version_is_refused_with_the_patch_that_fails(tmp_path):
    checkout = tmp_path / "checkout"
    shutil.copytree(STOCK_ROOT / "megatron" / "training", checkout / "megatron" / "training")
    training = checkout / "megatron" / "training" / "training.py"
    call = "            num_microbatches=get_num_microbatches(),\n"
    training.write_text(training.read_text().replace(call, call.rstrip("\n") + "  # changed\n"))
    result = _use_patched(tmp_path / "cache", first_on_path=checkout)
    assert result.returncode != 0
    assert "PatchError: megatron_dynbatch's patches do not apply" in result.stderr
    assert "0002-train-step-dynamic-microbatches.patch does not apply" in result.stderr


# --- the patched train_step, in subprocesses ---------------------------------------------------


def _run_workers(jobs: dict) -> dict:
    """Run ``python this_file TREE MODE OUT`` per mode, concurrently; return the parsed outputs."""
    processes = {}
    for mode, (tree, out) in jobs.items():
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        processes[mode] = subprocess.Popen(
            [sys.executable, __file__, str(tree), mode, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    results = {}
    for mode, process in processes.items():
        log, _ = process.communicate(timeout=_SUBPROCESS_TIMEOUT_S)
        assert process.returncode == 0, f"{mode} worker failed:\n{log[-6000:]}"
        results[mode] = json.loads(pathlib.Path(jobs[mode][1]).read_text())
    return results


@pytest.fixture(scope="module")
def train_step_results(patched_tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    return _run_workers(
        {"stock": (STOCK_ROOT, out / "stock.json"), "patched": (patched_tree, out / "patched.json")}
    )


def test_patched_tree_is_the_one_imported(train_step_results, patched_tree):
    assert train_step_results["patched"]["training_file"].startswith(str(patched_tree))
    assert train_step_results["stock"]["training_file"].startswith(str(STOCK_ROOT))


def test_flag_off_train_step_and_evaluate_are_bitwise_stock(train_step_results):
    stock = train_step_results["stock"]["off"]
    patched = train_step_results["patched"]["off"]
    assert patched == stock
    # And it is a real step: the loss is the token mean over the three micro-batches.
    assert stock["loss"] == pytest.approx(stock["reference_loss"], rel=1e-5)
    assert stock["scheduler_steps"] == 3  # 3 micro-batches x mbs 1 x dp 1


def test_flag_on_validation_resolves_the_config_once(train_step_results):
    on = train_step_results["patched"]["on"]
    assert "--calculate-per-token-loss" in on["missing_per_token_loss_error"]
    assert on["resolved"] == [24, "packed", 2]
    assert on["namespace_layout"] is None  # not written back into Megatron's arguments
    assert "--max-tokens-per-gpu given without --use-dynamic-batch-size" in on["stray_error"]
    assert "--rollouts-per-step 2 differs from --global-batch-size 3" in on["rollouts_error"]


def test_flag_on_train_step_serves_planned_steps(train_step_results):
    on = train_step_results["patched"]["on"]
    steps = on["steps"]
    # 8 samples in 6 rollouts, 2 rollouts per step: steps of rollouts {a,b}, {c,d}, {e,f}, all
    # from one pull of the iterator (a host's own: not read ahead without
    # --dynamic-batch-plan-ahead, test_the_next_batch_is_planned_while_a_step_trains_...).
    assert [s["pulls"] for s in steps] == [1, 1, 1]
    assert [s["indices"] for s in steps] == [[0, 1, 2, 3], [4, 5], [6, 7]]
    assert [s["step_index"] for s in steps] == [0, 1, 2]
    for step in steps:
        # The loss Megatron's train_step reports is the token mean over exactly the step's samples,
        # computed from the pre-step weights by running each sample alone.
        assert step["loss"] == pytest.approx(step["reference_loss"], rel=1e-5)
        # The LR schedule advances by --global-batch-size (2 rollouts), which the step trained.
        assert step["scheduler_increment"] == step["num_rollouts"] == 2
        assert step["seq_length"] <= 24 and step["params_changed"]
    assert len({(s["num_microbatches"], s["seq_length"]) for s in steps}) > 1


# --- the hook on 2 DP ranks ---------------------------------------------------------------------


def _hook_args(*flags):
    """Megatron's arguments of the two-rank hook tests: a 16-token budget, steps of 6 samples."""
    import argparse

    import torch

    from megatron_dynbatch.integrations.megatron_lm.arguments import add_dynamic_batch_args

    args = add_dynamic_batch_args(argparse.ArgumentParser()).parse_args(
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "16", *flags]
    )
    args.data_parallel_size = torch.distributed.get_world_size()
    args.calculate_per_token_loss = True
    args.global_batch_size = 6
    return args


def _rollout_batch(lengths):
    import torch

    from megatron_dynbatch.runtime.batches import RolloutBatch

    return RolloutBatch(samples=[{"tokens": torch.arange(1, n + 1)} for n in lengths])


def _two_rank_body(mismatch: str):
    import torch

    from megatron_dynbatch.integrations.megatron_lm import hooks as training_hooks
    from megatron_dynbatch.mcore.agreement import StepAgreementError

    args = _hook_args()
    lengths = [3, 9, 5, 12, 7, 2]
    if mismatch == "lengths" and torch.distributed.get_rank() == 1:
        lengths[0] = 14  # this rank's iterator yields another batch of the same size
    if mismatch == "size" and torch.distributed.get_rank() == 1:
        lengths = lengths + [4]  # this rank's iterator yields one sample too many
    batch = _rollout_batch(lengths)
    training_hooks.reset_dynamic_batch_state()
    try:
        step = training_hooks.prepare_train_step(args, iter([batch]), [torch.nn.Linear(1, 1)])
    except StepAgreementError as error:
        return type(error).__name__, str(error)
    finally:
        training_hooks.reset_dynamic_batch_state()
    shapes = {tuple(mb["tokens"].shape) for mb in step.microbatches}
    return step.sample_indices, step.num_microbatches, shapes, step.num_samples


def test_hook_splits_one_global_batch_over_dp_ranks():
    from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks

    results = run_on_ranks(2, _two_rank_body, "", layout=Layout())
    (indices0, m0, shapes0, n0), (indices1, m1, shapes1, n1) = results
    assert sorted(indices0 + indices1) == list(range(6)) and not set(indices0) & set(indices1)
    assert m0 == m1 and shapes0 == shapes1 and len(shapes0) == 1 and n0 == n1 == 6


def test_hook_raises_on_every_rank_when_plans_differ():
    from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks

    messages = run_on_ranks(2, _two_rank_body, "lengths", layout=Layout())
    for kind, message in messages:
        assert kind == "PlanMismatchError"
        assert "derived a different plan than rank 0" in message
        assert "ranks [1]" in message and "same global rollout batch" in message


def test_a_batch_of_the_wrong_size_stops_every_rank_with_the_same_error():
    from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks

    messages = run_on_ranks(2, _two_rank_body, "size", layout=Layout())
    assert messages[0] == messages[1]
    kind, message = messages[0]
    assert kind == "StepAgreementError" and "rank 1:" in message and "rank 0:" not in message
    assert "batch of 7 samples, but --global-batch-size is 6" in message


def _plan_ahead_body(flag: str, bad_second_batch: bool):
    import torch

    from megatron_dynbatch.integrations.megatron_lm import hooks as training_hooks
    from megatron_dynbatch.mcore.agreement import StepAgreementError

    args = _hook_args(*([flag] if flag else []), "--dynamic-batch-calibration-steps", "0")
    batches = [[3, 9, 5, 12, 7, 2], [14, 1, 6, 6, 9, 3], [2, 2, 11, 15, 4, 8]]
    if bad_second_batch and torch.distributed.get_rank() == 1:
        batches[1] = batches[1] + [4]  # one sample too many, on one rank only
    reads = []

    def read():
        for lengths in batches:
            reads.append(len(reads))
            yield _rollout_batch(lengths)

    data = read()
    training_hooks.reset_dynamic_batch_state()
    steps = []
    try:
        for _ in range(3):
            step = training_hooks.prepare_train_step(args, data, [torch.nn.Linear(1, 1)])
            steps.append((step.plan_fingerprint, step.planned_ahead, len(reads)))
        line = training_hooks.dynamic_log_string()
    except StepAgreementError as error:
        return steps, str(error)
    finally:
        training_hooks.reset_dynamic_batch_state()
    return steps, line


def test_the_next_batch_is_planned_while_a_step_trains_into_the_same_plans():
    from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks

    ahead = run_on_ranks(2, _plan_ahead_body, "--dynamic-batch-plan-ahead", False, layout=Layout())
    now = run_on_ranks(2, _plan_ahead_body, "--no-dynamic-batch-plan-ahead", False, layout=Layout())
    # A host's own iterator (this generator) may make its next batch from the model a step
    # trains: read ahead only when asked.
    default = run_on_ranks(2, _plan_ahead_body, "", False, layout=Layout())
    for (steps, line), (steps_now, _) in zip(default, now, strict=True):
        assert steps == steps_now and "planned ahead" not in line
    for (steps, line), (steps_now, line_now) in zip(ahead, now, strict=True):
        # The iteration line counts the batches planned ahead (none with the flag off).
        assert "| planned ahead: 2/3 |" in line and "planned ahead" not in line_now
        # The same plans; the second and third batches planned ahead, each read as soon as the
        # step before it was prepared (the third read after step 2: none after the last batch).
        assert [s[0] for s in steps] == [s[0] for s in steps_now]
        assert len({s[0] for s in steps}) == 3
        assert [s[1] for s in steps] == [False, True, True]
        assert [s[2] for s in steps] == [2, 3, 3]
        assert [s[1:] for s in steps_now] == [(False, 1), (False, 2), (False, 3)]


def test_a_bad_batch_read_ahead_stops_every_rank_at_the_step_that_needs_it():
    from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks

    results = run_on_ranks(2, _plan_ahead_body, "--dynamic-batch-plan-ahead", True, layout=Layout())
    (steps0, error0), (steps1, error1) = results
    # Read after step 1 was prepared; raised when step 2 needs it, on both ranks alike.
    assert len(steps0) == len(steps1) == 1 and error0 == error1
    assert "rank 1:" in error0 and "rank 0:" not in error0
    assert "batch of 7 samples, but --global-batch-size is 6" in error0


def _timed_step_body():
    import sys
    import types

    import megatron.core.timers as megatron_timers
    import torch

    from megatron_dynbatch.cpu.core_shim import cpu_torch_proxy
    from megatron_dynbatch.integrations.megatron_lm import hooks as training_hooks

    args = _hook_args()
    batch = _rollout_batch([3, 9, 5, 12, 7, 2])
    timers = megatron_timers.Timers(2, "minmax")  # --timing-log-level 2
    # The hook reads Megatron's timers where initialize_megatron keeps them, in
    # megatron.training.global_vars, only when that module is loaded (it never imports it).
    name = "megatron.training.global_vars"
    loaded = sys.modules.get(name)
    global_vars = loaded or types.ModuleType(name)
    saved = getattr(global_vars, "_GLOBAL_TIMERS", None), megatron_timers.torch
    global_vars._GLOBAL_TIMERS = timers
    sys.modules[name] = global_vars
    megatron_timers.torch = cpu_torch_proxy()  # as the launch's CPU shim gives Megatron's timers
    training_hooks.reset_dynamic_batch_state()
    try:
        training_hooks.prepare_train_step(args, iter([batch]), [torch.nn.Linear(1, 1)])
    finally:
        global_vars._GLOBAL_TIMERS, megatron_timers.torch = saved
        if loaded is None:
            del sys.modules[name]
        training_hooks.reset_dynamic_batch_state()
    timer = timers._timers.get("batch-generator")
    return None if timer is None else timer.elapsed(reset=False)


def test_preparing_a_step_is_timed_as_megatrons_batch_generator():
    """--timing-log-level 2: reading and building the step's micro-batches is its data time (the
    forward steps read micro-batches already built)."""
    from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks

    for seconds in run_on_ranks(2, _timed_step_body, layout=Layout()):
        assert seconds is not None and seconds > 0


# --- worker: runs in a subprocess with TREE first on sys.path ------------------------------------

_ARGV = [
    "pretrain",
    "--num-layers", "2",
    "--hidden-size", "32",
    "--num-attention-heads", "4",
    "--seq-length", "16",
    "--max-position-embeddings", "256",
    "--micro-batch-size", "1",
    "--global-batch-size", "3",
    "--train-iters", "3",
    "--lr", "0.1",
    "--lr-decay-style", "constant",
    "--optimizer", "sgd",
    "--clip-grad", "0",
    "--vocab-size", "128",
    "--tokenizer-type", "NullTokenizer",
    "--transformer-impl", "local",
    "--no-gradient-accumulation-fusion",
    "--calculate-per-token-loss",
]  # fmt: skip
_DYNAMIC_ARGV = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "24"] + [
    "--rollouts-per-step",
    "2",
    "--global-batch-size",
    "2",
]


def _worker_setup(tree: str):
    sys.path.insert(0, tree)
    from megatron_dynbatch.cpu.training_shim import apply_training_cpu_shim

    apply_training_cpu_shim()
    import megatron.training.training as training
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    assert os.path.realpath(training.__file__).startswith(os.path.realpath(tree)), training.__file__
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    return training.__file__


def _worker_parse(argv, provider):
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import destroy_global_vars

    destroy_global_vars()
    destroy_num_microbatches_calculator()
    sys.argv = list(argv)
    return parse_and_validate_args(extra_args_provider=provider)


def _worker_build():
    import torch
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.training import get_optimizer_param_scheduler

    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        tiny_transformer_config,
        wrap_in_ddp,
    )

    config = tiny_transformer_config(num_layers=2)
    config.finalize_model_grads_func = finalize_model_grads
    model = wrap_in_ddp(build_tiny_gpt(config, seed=3))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=0.1, clip_grad=0.0, params_dtype=torch.float32), model
    )
    return config, model, optimizer, get_optimizer_param_scheduler(optimizer)


def _worker_samples(lengths, seed):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [
        {"tokens": torch.randint(1, 128, (n,), generator=generator), "prompt_length": n // 3}
        for n in lengths
    ]


def _worker_params(model):
    from megatron_dynbatch.tools.testing.tiny_gpt import named_global_params

    return {name: p.detach().clone() for name, p in named_global_params(model).items()}


def _worker_reference_loss(model, samples):
    """Token-mean next-token loss of ``samples``, each run alone through the unwrapped model."""
    import torch

    from megatron_dynbatch.mcore.forward import build_attention_mask

    total, count = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            n = sample["tokens"].shape[0]
            labels = torch.cat([sample["tokens"][1:], torch.zeros(1, dtype=torch.int64)])
            mask = torch.zeros(n)
            # Position j predicts token j + 1: a target when token j + 1 is a response token.
            mask[max(sample["prompt_length"] - 1, 0) : n - 1] = 1
            per_token = model[0].module(
                sample["tokens"][None],
                torch.arange(n)[None],
                build_attention_mask(torch.zeros(1, n, dtype=torch.int64)),
                labels=labels[None],
            )[0]
            total += float((per_token * mask).sum())
            count += int(mask.sum())
    return total / count


def _worker_train_step(model, optimizer, scheduler, config, data_iterator):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training.training import train_step

    from megatron_dynbatch.mcore.forward import make_forward_step
    from megatron_dynbatch.runtime import microbatch_loss

    forward_step = make_forward_step(lambda batch, loss: microbatch_loss("token-mean", loss, batch))
    loss_dict, skipped = train_step(
        forward_step, data_iterator, model, optimizer, scheduler, config,
        get_forward_backward_func(), iteration=0,
    )[:2]  # fmt: skip
    assert skipped == 0
    return float(loss_dict["loss"])


def _worker_evaluate(model, config, microbatches):
    """Megatron's (patched) evaluate(): one validation iteration of the 3 micro-batches."""
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.training.training import evaluate

    from megatron_dynbatch.mcore.forward import make_forward_step
    from megatron_dynbatch.runtime import microbatch_loss

    forward_step = make_forward_step(
        lambda batch, loss: microbatch_loss("token-mean", loss, batch, log_key="lm loss")
    )
    totals, _, _ = evaluate(
        forward_step, RerunDataIterator(iter(microbatches)), model, None, config, eval_iters=1
    )
    return float(totals["lm loss"])


def _worker_flag_off(provider):
    """One stock-shaped step: 3 fixed micro-batches of [1, 16], Megatron's own data path."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    from megatron_dynbatch.planning import PlannerConfig, plan_schedule
    from megatron_dynbatch.runtime import BatchSchema, materialize_microbatches

    _worker_parse(_ARGV, provider)
    config, model, optimizer, scheduler = _worker_build()
    samples = _worker_samples([16, 16, 16], seed=1)
    step = plan_schedule([16] * 3, config=PlannerConfig(max_tokens_per_gpu=16)).steps[0]
    assert (step.num_microbatches, step.seq_length) == (3, 16)
    microbatches = materialize_microbatches(
        step, 0, dict(enumerate(samples)), BatchSchema(), layout="packed", sample_multiple=1
    )
    reference = _worker_reference_loss(model, samples)
    data_iterator = RerunDataIterator(iter(microbatches))
    loss = _worker_train_step(model, optimizer, scheduler, config, data_iterator)
    return {
        "loss": loss,
        "eval_loss": _worker_evaluate(model, config, microbatches),
        "reference_loss": reference,
        "scheduler_steps": scheduler.num_steps,
        "params": {k: v.double().sum().item() for k, v in _worker_params(model).items()},
    }


def _worker_flag_on():
    from megatron.core.rerun_state_machine import RerunDataIterator

    from megatron_dynbatch.integrations.megatron_lm import hooks as training_hooks
    from megatron_dynbatch.integrations.megatron_lm.arguments import add_dynamic_batch_args
    from megatron_dynbatch.runtime.batches import RolloutBatch
    from megatron_dynbatch.tools.testing.tiny_gpt import named_global_params

    result = {}
    no_per_token = [a for a in _ARGV if a != "--calculate-per-token-loss"]
    try:
        _worker_parse(no_per_token + _DYNAMIC_ARGV, add_dynamic_batch_args)
    except ValueError as error:
        result["missing_per_token_loss_error"] = str(error)
    try:
        _worker_parse(_ARGV + _DYNAMIC_ARGV[:-2], add_dynamic_batch_args)  # gbs 3, 2 per step
    except ValueError as error:
        result["rollouts_error"] = str(error)
    try:
        _worker_parse(_ARGV + ["--max-tokens-per-gpu", "24"], add_dynamic_batch_args)
    except ValueError as error:
        result["stray_error"] = str(error)
    args = _worker_parse(_ARGV + _DYNAMIC_ARGV, add_dynamic_batch_args)
    # Resolved once into the hooks' state; the namespace keeps what the command line said.
    resolved = training_hooks.hooks_for(args).config
    result["resolved"] = [resolved.max_tokens_per_gpu, resolved.layout, resolved.rollouts_per_step]
    result["namespace_layout"] = args.dynamic_batch_layout

    config, model, optimizer, scheduler = _worker_build()
    samples = _worker_samples([5, 9, 12, 3, 7, 16, 4, 11], seed=2)
    batch = RolloutBatch(samples=samples, rollout_ids=["a", "a", "b", "b", "c", "d", "e", "f"])
    pulls = []

    def rollout_batches():
        while True:
            pulls.append(1)
            yield batch

    data_iterator = RerunDataIterator(rollout_batches())
    training_hooks.reset_dynamic_batch_state()
    steps = []
    for _ in range(3):
        before_params = _worker_params(model)
        before_scheduler = scheduler.num_steps
        loss = _worker_train_step(model, optimizer, scheduler, config, data_iterator)
        step = training_hooks.last_train_step()
        after_params = _worker_params(model)
        # Reference from the pre-step weights: put them back, measure, restore.
        named = named_global_params(model)
        for name, param in named.items():
            param.data.copy_(before_params[name])
        reference = _worker_reference_loss(model, [samples[i] for i in step.sample_indices])
        for name, param in named.items():
            param.data.copy_(after_params[name])
        steps.append(
            {
                "loss": loss,
                "reference_loss": reference,
                "indices": sorted(step.sample_indices),
                "step_index": step.step_index,
                "num_microbatches": step.num_microbatches,
                "seq_length": step.seq_length,
                "num_samples": step.num_samples,
                "num_rollouts": step.num_rollouts,
                "scheduler_increment": scheduler.num_steps - before_scheduler,
                "params_changed": any(
                    not before_params[k].equal(after_params[k]) for k in before_params
                ),
                "pulls": len(pulls),
            }
        )
    result["steps"] = steps
    return result


def _worker_main(tree: str, mode: str, out: str) -> None:
    result = {"training_file": _worker_setup(tree)}
    if mode == "stock":
        result["off"] = _worker_flag_off(None)
    else:
        from megatron_dynbatch.integrations.megatron_lm.arguments import add_dynamic_batch_args

        result["off"] = _worker_flag_off(add_dynamic_batch_args)
        result["on"] = _worker_flag_on()
    pathlib.Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    _worker_main(*sys.argv[1:4])
