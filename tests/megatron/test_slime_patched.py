"""slime's own Megatron backend, patched by ``patches/slime``, against a per-sample reference.

With ``SLIME_DIR`` (a slime checkout at the commit named in ``patches/slime/README.md``) the
patches are applied to a copy with ``launch/apply_slime_patches.sh``, and on gloo CPU ranks
(tiny GPT, pp 2 at dp 1 and 2, pp 2 x vpp 2) slime's real ``get_data_iterator``, ``get_batch``,
``forward_only`` (with ``get_log_probs_and_entropy``) and ``train_one_step`` (with
``policy_loss_function``) run on rollout data scheduled by our ``build_dp_schedule``. Checked: every step's gradients equal a
single process running each sample alone (relative 1e-5), in both of slime's loss modes (per
token, per rollout), on a layout where one DP rank holds only placeholders too; log-probs come
back in rollout order; a bad sample on one rank stops every rank with the same error; with the
flag off, the patched tree trains bitwise like the stock checkout. With a tiny Megatron-Core MoE
(4 layers, 4 experts, top-2) at pp 2, dp 2 (EP 1 and 2, and pp 2 x vpp 2), MoE routing replay R2
(``--use-routing-replay``) and R3 (``--use-rollout-routing-replay``, patch 0008) match the
per-sample reference too, and every recorded routing is replayed exactly once.

What is not slime's in these runs, and why:

* modules slime imports for rollout serving and logging, when not installed, are stubbed:
  ``ray``, ``sglang``, ``sglang_router``, ``requests`` (the last two for slime's argument
  parser), ``torch_memory_saver``, ``wandb``, ``httpx``, ``tensorboard`` (:data:`STUBBED`; the
  test reports which were);
* the model is the tiny GPT of ``megatron_dynbatch.tools.testing`` (slime's model provider needs a
  Hugging Face checkpoint), behind a wrapper that turns slime's THD ``packed_seq_params`` into a
  block-diagonal attention mask, because THD attention needs transformer-engine (GPU only);
* slime's accelerator is a CPU backend installed through its public ``set_accelerator``;
* MoE cases: slime's Megatron patch (``register_routing_replay`` in ``TopKRouter.__init__``,
  ``get_routing_replay_compute_topk`` around the router's top-k) is reached through the
  ``router_replay`` hook that megatron.core 0.19.2 calls at the same point (:class:`_SlimeTopk`);
  the pinned host copy in slime's ``RoutingReplay.record`` is unpinned (CPU-only torch has no
  pinned allocator); ``fill_routing_replay`` runs lifted out of its Ray actor class;
* the optimizer and LR scheduler are recorders: ``train_one_step`` zeroes the gradients after the
  optimizer step, so the recorder keeps them;
* the rollout side's ``RolloutManager._split_train_data_by_dp`` (``rollout.py``, patch 0001) is a
  method of a Ray actor: :func:`_rank_rollout_data` runs its source lifted out of the class, with
  ``ray.put`` / ``ray.get`` as identities, then slime's own ``process_rollout_data``; advantages,
  which slime's trainer computes from rewards, are given.

Without ``SLIME_DIR`` the slime-backed tests are skipped; the backend's own pieces
(placeholders, iterators, ordering) are tested here without slime.
"""

import contextlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

apply_cpu_shim()

from megatron_dynbatch.errors import DynBatchValueError  # noqa: E402
from megatron_dynbatch.integrations.slime.backend import (  # noqa: E402
    SlimeDataIterator,
    placeholder_sample,
    restore_rollout_order,
)
from megatron_dynbatch.integrations.slime.hook import HOOK_PATH  # noqa: E402
from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks  # noqa: E402
from tests._support import (  # noqa: E402
    FAIL_FAST_S,
    SLIME_STUBBED,
    host_patches,
    patched_copy,
    relative_error,
    stock_copy,
)

pytestmark = pytest.mark.gloo

REPO = pathlib.Path(__file__).resolve().parents[2]
APPLY = REPO / "launch" / "apply_slime_patches.sh"
SLIME_DIR = os.environ.get("SLIME_DIR")
REL_TOL = 1e-5
SEED = 5
VOCAB = 128
#: Modules slime imports for rollout serving and logging, stubbed when they are not installed.
STUBBED = SLIME_STUBBED

#: The tiny MoE of the routing-replay cases: 4 layers, 4 experts, top-2.
MOE = {"num_layers": 4, "num_moe_experts": 4, "moe_router_topk": 2}

# Skipped without SLIME_DIR (tests/conftest.py); the fast default deselects them.
needs_slime = pytest.mark.slime


# -- the backend without slime ----------------------------------------------------------------


def _local_data():
    return {
        "tokens": [torch.arange(6), torch.arange(4)],
        "total_lengths": [6, 4],
        "response_lengths": [3, 2],
        "loss_masks": [torch.ones(3, dtype=torch.int), torch.tensor([1, 0], dtype=torch.int)],
        "advantages": [torch.ones(3), torch.ones(2)],
        "rollout_mask_sums": torch.tensor([3.0, 1.0]),
        "multimodal_train_inputs": None,
    }


def test_placeholder_is_a_full_length_loss_masked_sample_with_every_key():
    data = _local_data()
    keys = ["tokens", "total_lengths", "response_lengths", "loss_masks", "advantages"]
    keys += ["rollout_mask_sums", "multimodal_train_inputs", "log_probs"]
    sample = placeholder_sample(data, keys, 16)
    assert sample["tokens"].shape == (16,) and sample["tokens"].dtype == torch.long
    assert sample["total_lengths"] == 16 and sample["response_lengths"] == 15
    assert sample["loss_masks"].shape == (15,) and int(sample["loss_masks"].sum()) == 0
    assert sample["advantages"].shape == (15,) and sample["rollout_mask_sums"] == 0
    assert sample["multimodal_train_inputs"] is None and sample["log_probs"] is None
    with pytest.raises(DynBatchValueError, match="'new_key'"):
        placeholder_sample({**data, "new_key": [1, 2]}, ["new_key"], 16)


def test_iterator_yields_placeholders_and_row_lengths_and_checks_samples():
    data = _local_data()
    iterator = SlimeDataIterator(data, [[0, 1], []], [128, 128])
    iterator.check_microbatches(2)
    first = iterator.get_next(["tokens", "total_lengths"])
    assert first["total_lengths"] == [6, 4] and iterator.row_length == 128
    second = iterator.get_next(["tokens", "total_lengths", "multimodal_train_inputs"])
    assert second["total_lengths"] == [128] and second["multimodal_train_inputs"] is None
    with pytest.raises(DynBatchValueError, match="micro-batch 2 requested"):
        iterator.get_next(["tokens"])
    bad = _local_data()
    bad["advantages"][1] = torch.tensor([1.0, float("nan")])  # masked: fine
    SlimeDataIterator(bad, [[0, 1]], [128]).check_microbatches(1)
    bad["advantages"][1] = torch.tensor([float("nan"), 1.0])  # on a loss token: an error
    with pytest.raises(DynBatchValueError, match=r"advantages\[0\]=nan is not finite"):
        SlimeDataIterator(bad, [[0, 1]], [128]).check_microbatches(1)
    with pytest.raises(DynBatchValueError, match="more than the step's row length 8"):
        SlimeDataIterator(data, [[0, 1]], [8]).check_microbatches(1)


def test_forward_outputs_return_in_rollout_order_without_placeholders():
    data = _local_data()
    iterator = SlimeDataIterator(data, [[1], [], [0]], [16, 16, 16])
    assert restore_rollout_order([["b"], ["ph"], ["a"]], iterator) == ["a", "b"]
    with pytest.raises(DynBatchValueError, match="2 outputs for 1 sample"):
        restore_rollout_order([["b", "x"], ["ph"], ["a"]], iterator)
    with pytest.raises(DynBatchValueError, match="2 forward-only outputs for 3"):
        restore_rollout_order([["b"], ["a"]], iterator)


# -- the patches on slime ---------------------------------------------------------------------


PATCHES = host_patches("slime")


@pytest.fixture(scope="module")
def stock_slime(tmp_path_factory):
    """A pristine copy of SLIME_DIR's ``slime/`` (our patches reverse-applied if it holds them)."""
    return stock_copy(SLIME_DIR, "slime", tmp_path_factory.mktemp("slime_stock"))


@pytest.fixture(scope="module")
def patched_slime(tmp_path_factory, stock_slime):
    """The stock copy with our patches applied by ``launch/apply_slime_patches.sh``."""
    return patched_copy(stock_slime, "slime", tmp_path_factory.mktemp("slime_patched"))


def _oversize_body(slime_root, argv, patched):
    """slime's own parser (the patched one registers --oversize-samples) on ``argv``, then the
    rollout side's schedule, ours (``patched``) or slime's: where sample 0 (100 tokens, over the
    budget of 64) trains, the warnings, or the error."""
    import argparse
    import warnings

    _install_stubs()
    _import_slime(slime_root)
    from slime.utils.arguments import get_slime_extra_args_provider

    parser = argparse.ArgumentParser()
    get_slime_extra_args_provider()(parser)
    args, _ = parser.parse_known_args(argv)
    if patched:
        from megatron_dynbatch.adapters.slime import build_dp_schedule
    else:
        from slime.utils.dp_schedule import build_dp_schedule
    lengths = [100, 20, 30, 40]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            partitions, mbi, _, _ = build_dp_schedule(
                args,
                {
                    "dp_size": 2,
                    "cp_size": 1,
                    "vpp_size": 1,
                    "microbatch_group_size_per_vp_stage": 1,
                },
                lengths,
                global_batch_size=4,
                rollout_indices=list(range(4)),
            )
        except ValueError as error:
            return {"error": str(error)}
    [rank] = [r for r, p in enumerate(partitions) if 0 in p]
    [microbatch] = [mb for mb in mbi[rank] if partitions[rank].index(0) in mb]
    return {
        "policy": getattr(args, "oversize_samples", None),
        "alone": len(microbatch) == 1,
        "trained": sorted(i for p in partitions for i in p),
        "warnings": [str(w.message) for w in caught if "exceed the token cap" in str(w.message)],
    }


@needs_slime
def test_a_working_slime_config_with_an_oversize_sample_still_trains(stock_slime, patched_slime):
    """A sample over --max-tokens-per-gpu trains alone in stock slime; the patched slime with the
    same flags (--oversize-samples left at its default, allow) trains it alone too, warning once
    with the sample and slime's flags; --oversize-samples error (opt-in) stops naming it."""
    argv = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--rollout-batch-size", "4"]
    [stock] = run_on_ranks(1, _oversize_body, stock_slime, argv, False, layout=Layout())
    assert stock["alone"] and stock["trained"] == [0, 1, 2, 3], stock
    [mine] = run_on_ranks(1, _oversize_body, patched_slime, argv, True, layout=Layout())
    assert mine["policy"] == "allow" and mine["alone"] and mine["trained"] == [0, 1, 2, 3], mine
    [warning] = mine["warnings"]
    assert "sample 0: 100 tokens" in warning and "--max-tokens-per-gpu" in warning
    assert "--oversize-samples error" in warning and "truncate" not in warning
    argv += ["--oversize-samples", "error"]
    [refused] = run_on_ranks(1, _oversize_body, patched_slime, argv, True, layout=Layout())
    assert "sample 0: 100 tokens" in refused["error"], refused


@needs_slime
def test_slimes_own_argument_tests_pass_on_the_patched_tree_as_on_stock(stock_slime, patched_slime):
    """A probe: slime's ``tests/test_megatron_argument_validation.py`` builds namespaces by hand,
    switch off and without our options; the patched ``slime_validate_args`` read
    ``args.micro_batch_planner_path`` unguarded (12 of its 21 tests failed with AttributeError,
    all passing on stock). The patches read it with ``getattr`` (switch off: as unpatched)."""
    upstream = pathlib.Path(SLIME_DIR) / "tests" / "test_megatron_argument_validation.py"
    if not upstream.exists():
        pytest.skip(f"{upstream} is not in this slime checkout")
    outcomes = []
    for root in (stock_slime, patched_slime):
        tests = pathlib.Path(root) / "tests"
        tests.mkdir(exist_ok=True)
        shutil.copy(upstream, tests / upstream.name)  # it loads ../slime/... relative to itself
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
             str(tests / upstream.name)],
            cwd=root, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        outcomes.append((run.returncode, re.findall(r"\d+ (?:passed|failed|error)", run.stdout)))
    stock, patched = outcomes
    assert stock[0] == 0 and patched == stock, (stock, patched)


@needs_slime
def test_apply_is_idempotent_and_refuses_other_trees(tmp_path, stock_slime, patched_slime):
    again = subprocess.run(["bash", str(APPLY), patched_slime], capture_output=True, text=True)
    assert again.returncode == 0 and "already applied" in again.stdout
    shutil.copytree(pathlib.Path(stock_slime) / "slime", tmp_path / "slime")
    model = tmp_path / "slime" / "backends" / "megatron_utils" / "model.py"
    # Another slime: a context line of patch 0003 differs.
    model.write_text(
        model.read_text().replace("    # reset data iterator\n", "    # reset iterators\n")
    )
    before = {p: p.read_bytes() for p in (tmp_path / "slime").rglob("*.py")}
    refused = subprocess.run(["bash", str(APPLY), str(tmp_path)], capture_output=True, text=True)
    assert refused.returncode == 1 and "nothing was changed" in refused.stderr
    # The report names the patch and the hunk that failed, for a rebase of a few lines.
    assert "0003-forward-only-logprob-plan.patch does not apply" in refused.stderr
    assert "Hunk #2 FAILED" in refused.stderr  # hunk 1 is the import line
    assert before == {p: p.read_bytes() for p in (tmp_path / "slime").rglob("*.py")}


def _install_stubs():
    """Stand-ins for the STUBBED modules that are not installed; returns every module this
    process answers with a stand-in (the shared harness,
    ``megatron_dynbatch.tools.testing.host_stubs``)."""
    from megatron_dynbatch.tools.testing.host_stubs import install_stubs

    return install_stubs(STUBBED)


def _rollout_batch(num_rollouts, sizes_seed=SEED, routed_experts=False):
    gen = torch.Generator().manual_seed(sizes_seed)
    data = {k: [] for k in ("tokens", "response_lengths", "loss_masks", "rollout_ids", "adv")}
    for rollout in range(num_rollouts):
        prompt = int(torch.randint(2, 8, (1,), generator=gen))
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            response = int(torch.randint(2, 36, (1,), generator=gen))
            data["tokens"].append(torch.randint(0, VOCAB, (prompt + response,), generator=gen))
            data["response_lengths"].append(response)
            mask = (torch.rand(response, generator=gen) > 0.2).int()
            if rollout == 1:
                mask[:] = 0  # a fully masked sample: slime's per-token count would say 1
            data["loss_masks"].append(mask)
            data["rollout_ids"].append(rollout)
            data["adv"].append(torch.randn(response, generator=gen))
    totals = {}
    for rid, mask in zip(data["rollout_ids"], data["loss_masks"], strict=True):
        totals[rid] = totals.get(rid, 0) + int(mask.sum())
    data["rollout_mask_sums"] = [totals[rid] for rid in data["rollout_ids"]]
    data["rewards"] = [float(r) for r in torch.randn(len(data["tokens"]), generator=gen)]
    if routed_experts:
        # R3: the experts the rollout engine chose, [tokens - 1, layers, topk] per sample (the
        # last token is never scored); random, so they differ from what the model would choose
        # and a row that lands on the wrong tokens changes the numbers.
        experts, layers, topk = MOE["num_moe_experts"], MOE["num_layers"], MOE["moe_router_topk"]
        data["routed_experts"] = [
            torch.rand(len(t) - 1, layers, experts, generator=gen).argsort(-1)[..., :topk]
            for t in data["tokens"]
        ]
    return data


def _slime_args(per_token, max_tokens, pp):
    import types

    return types.SimpleNamespace(
        use_dynamic_batch_size=True,
        # As slime's validation leaves it with --use-dynamic-batch-size (patch 0005).
        micro_batch_planner_path=HOOK_PATH,
        max_tokens_per_gpu=max_tokens,
        log_probs_max_tokens_per_gpu=2 * max_tokens,
        micro_batch_size=1,
        balance_data=False,
        balance_by_flops=False,
        data_pad_size_multiplier=16,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=pp,
        microbatch_group_size_per_vp_stage=None,
        calculate_per_token_loss=per_token,
        loss_type="policy_loss",
        advantage_estimator="grpo",
        eps_clip=0.2,
        eps_clip_high=0.28,
        eps_clip_c=None,
        entropy_coef=0.0,
        use_kl_loss=False,
        kl_coef=0.0,
        use_tis=False,
        use_opsm=False,
        get_mismatch_metrics=False,
        use_rollout_logprobs=False,
        use_rollout_entropy=False,
        custom_pg_loss_reducer_function_path=None,
        recompute_loss_function=False,
        allgather_cp=False,
        log_probs_chunk_size=-1,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        seq_length=256,
        decoder_seq_length=None,
        enable_mtp_training=False,
        save_debug_train_data=None,
        custom_megatron_before_train_step_hook_path=None,
        custom_megatron_before_log_prob_hook_path=None,
        check_for_nan_in_loss_and_grad=True,
        ci_test=False,
        global_batch_size=None,
    )


def _constant(value):
    return lambda self, *args, **kwargs: value


def _use_cpu_accelerator():
    """Install a CPU backend through slime's public ``set_accelerator`` (slime ships cuda, musa)."""
    from slime.utils import accelerator
    from slime.utils.accelerator.base import Accelerator

    answers = {
        "is_available": True,
        "device_name": "cpu",
        "current_device": "cpu",
        "device_count": 1,
        "mem_get_info": (0, 0),
        "memory_allocated": 0,
        "memory_reserved": 0,
    }
    methods = {}
    for name in Accelerator.__abstractmethods__:
        if name == "device":
            methods[name] = lambda self, index=None: torch.device("cpu")
        else:
            methods[name] = _constant(answers.get(name))
    cpu = type("CpuAccelerator", (Accelerator,), methods)()
    for attr, value in (
        ("name", "cpu"),
        ("device_type", "cpu"),
        ("communication_backend_name", "gloo"),
    ):
        setattr(cpu, attr, value)
    accelerator.set_accelerator(cpu)


def _rank_rollout_data(slime_root, args, tp_config, data, dp_rank):
    """What slime's rollout side (``rollout.py``, patched) and ``process_rollout_data`` hand to
    one DP rank: the real code of both, with Ray's object store as identities."""
    import ast
    import types

    from slime.observability.rollout_data_utils import tensorize_rollout_data_for_training
    from slime.utils import data as slime_utils_data
    from slime.utils.dp_schedule import build_dp_schedule as slimes_schedule
    from slime.utils.misc import Box, load_function

    path = pathlib.Path(slime_root) / "slime" / "ray" / "rollout.py"
    tree = ast.parse(path.read_text())
    [manager] = [n for n in tree.body if getattr(n, "name", None) == "RolloutManager"]
    [split] = [n for n in manager.body if getattr(n, "name", None) == "_split_train_data_by_dp"]
    store = types.SimpleNamespace(put=lambda value, **_: value, get=lambda value: value)
    namespace = {
        "build_dp_schedule": slimes_schedule,
        "load_function": load_function,
        "tensorize_rollout_data_for_training": tensorize_rollout_data_for_training,
        "Box": Box,
        "ray": store,
    }
    exec(compile(ast.Module(body=[split], type_ignores=[]), str(path), "exec"), namespace)
    rollout_side = {
        "tokens": [t.tolist() for t in data["tokens"]],
        "response_lengths": list(data["response_lengths"]),
        "loss_masks": [m.tolist() for m in data["loss_masks"]],
        "rollout_ids": list(data["rollout_ids"]),
        "rollout_mask_sums": [float(x) for x in data["rollout_mask_sums"]],
        "rewards": list(data["rewards"]),
    }
    if "routed_experts" in data:  # R3: what the rollout engine reports per sample
        rollout_side["rollout_routed_experts"] = [e.numpy() for e in data["routed_experts"]]
    this = types.SimpleNamespace(args=args, train_parallel_config=tp_config)
    refs = namespace["_split_train_data_by_dp"](this, rollout_side)
    slime_utils_data.ray = store
    local = slime_utils_data.process_rollout_data(args, refs, dp_rank, tp_config["dp_size"])
    local["advantages"] = [data["adv"][j] for j in local["partition"]]
    return local


def _import_slime(slime_root):
    """Put ``slime_root`` first on ``sys.path`` and forget any slime imported from another root
    (workers are reused across cases: one case may run the patched copy, the next the stock tree).
    """
    import sys

    for name in [n for n in sys.modules if n == "slime" or n.startswith("slime.")]:
        del sys.modules[name]
    sys.path[:] = [p for p in sys.path if p not in _SLIME_ROOTS]
    _SLIME_ROOTS.add(slime_root)
    sys.path.insert(0, slime_root)


_SLIME_ROOTS = set()


class _Recorder:
    """Optimizer / LR-scheduler stand-in: keeps each step's gradients before slime zeroes them."""

    def __init__(self, chunks):
        self.chunks = chunks
        self.steps = []
        self.increments = []
        self.param_groups = []

    def zero_grad(self):
        pass

    def step(self, increment=None):
        from megatron_dynbatch.tools.testing.tiny_gpt import named_global_grads

        if increment is not None:  # the LR scheduler's step
            self.increments.append(increment)
            return None
        self.steps.append({k: v.clone() for k, v in named_global_grads(self.chunks).items()})
        return True, 0.0, 0


def _thd_chunk(ddp_chunk, cp=1):
    """A model chunk taking slime's forward kwargs; THD cu_seqlens become a block mask (CPU).

    ``cp > 1``: the chunk has no attention (:func:`build_tiny_gpt` ``attention=False``), so this
    rank's zigzag pieces of every sample run as they are (no mask, positions unused)."""
    from megatron_dynbatch.mcore.forward import build_attention_mask

    class ThdAsMask(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self._modules["module"], name)

        def forward(self, input_ids, position_ids, attention_mask, labels, packed_seq_params, **kw):
            length = input_ids.shape[1]
            if cp > 1:
                bounds = packed_seq_params.cu_seqlens_q.to(torch.long)
                assert int(bounds[-1]) == length * cp, (bounds, length, cp)
                return self.module(input_ids, None, None)
            bounds = packed_seq_params.cu_seqlens_q.to(torch.long)
            assert int(bounds[-1]) == length, (bounds, length)
            positions = torch.arange(length)
            segment = torch.searchsorted(bounds[1:], positions, right=True)
            position_ids = (positions - bounds[segment]).unsqueeze(0)
            mask = build_attention_mask(segment.unsqueeze(0))
            # Megatron's padding mask for MoE routers (patch 0009), passed on as slime gives it.
            extra = {"padding_mask": kw["padding_mask"]} if "padding_mask" in kw else {}
            return self.module(input_ids, position_ids, mask, **extra)

    return ThdAsMask(ddp_chunk)


class _NoPinTorch:
    """``torch`` for slime's ``routing_replay`` module: pinned host memory needs an accelerator
    (CPU-only torch raises), so ``empty_like(..., pin_memory=True)`` allocates unpinned."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty_like(*args, pin_memory=False, **kwargs):
        del pin_memory
        return torch.empty_like(*args, **kwargs)


def _enable_routing_replay(args, replay):
    """slime's flags and environment for R2 / R3 (``actor_group.py`` sets the variable for
    actors when ``--use-routing-replay``; ``arguments.py`` turns R2 on with R3)."""
    from slime.utils import routing_replay

    args.use_routing_replay = True
    args.use_rollout_routing_replay = replay == "r3"
    args.num_experts = MOE["num_moe_experts"]
    # Megatron's model arguments in slime's namespace (the phantom sample's routed-expert shape).
    args.num_layers = MOE["num_layers"]
    args.moe_router_topk = MOE["moe_router_topk"]
    args.sequence_parallel = False
    os.environ["ENABLE_ROUTING_REPLAY"] = "1"
    os.environ["ROUTING_REPLAY_STAGE"] = "fallthrough"
    routing_replay.torch = _NoPinTorch()


def _disable_routing_replay():
    from slime.utils.routing_replay import RoutingReplay

    RoutingReplay.clear_all()
    os.environ.pop("ENABLE_ROUTING_REPLAY", None)
    os.environ.pop("ROUTING_REPLAY_STAGE", None)


class _SlimeTopk:
    """What slime's Megatron patch (``docker/patch/*/megatron.patch``, ``moe_utils.py``) does in
    ``topk_routing_with_score_function``: the top-k goes through
    ``get_routing_replay_compute_topk``. megatron.core 0.19.2 calls a router's ``router_replay``
    with the stock top-k at that very point, so this reaches the same code without patching
    Megatron."""

    @staticmethod
    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, compute_topk=None):
        from slime.utils.routing_replay import get_routing_replay_compute_topk

        return get_routing_replay_compute_topk(compute_topk)(scores, topk, num_groups, group_topk)


def _routers(chunks):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def _install_slime_router_hooks(chunks):
    """slime's Megatron patch of ``TopKRouter.__init__`` (``register_routing_replay``: one
    ``RoutingReplay`` per router, in layer order) and of its top-k (:class:`_SlimeTopk`)."""
    from slime.utils.routing_replay import register_routing_replay

    for router in _routers(chunks):
        register_routing_replay(router)
        router.router_replay = _SlimeTopk()


def _fill_routing_replay(slime_root, args, model, iterators, rollout_data):
    """``MegatronTrainRayActor.fill_routing_replay`` (``actor.py``, patched by 0008), lifted out
    of its Ray actor class: the actor module imports the rollout stack (transformers, Ray)."""
    import ast
    import types

    from slime.backends.megatron_utils import cp_utils

    path = pathlib.Path(slime_root) / "slime" / "backends" / "megatron_utils" / "actor.py"
    tree = ast.parse(path.read_text())
    [actor] = [n for n in tree.body if getattr(n, "name", None) == "MegatronTrainRayActor"]
    [fill] = [n for n in actor.body if getattr(n, "name", None) == "fill_routing_replay"]
    namespace = {
        "prepare_routed_experts_for_routing_replay": (
            cp_utils.prepare_routed_experts_for_routing_replay
        )
    }
    exec(compile(ast.Module(body=[fill], type_ignores=[]), str(path), "exec"), namespace)
    this = types.SimpleNamespace(args=args, model=model)
    namespace["fill_routing_replay"](
        this, iterators, rollout_data["num_microbatches"], rollout_data
    )


def _replay_counts():
    """Per router: (routings recorded, routings replayed by training's forward passes)."""
    from slime.utils.routing_replay import RoutingReplay

    return [(len(r.top_indices_list), r.forward_index) for r in RoutingReplay.all_routing_replays]


def _slime_body(
    slime_root,
    num_rollouts,
    gbs,
    max_tokens,
    per_token,
    bad_rank=None,
    dynamic=True,
    estimator=None,
    replay=None,
    attention=True,
    slimes_own=False,
    loss_fault=False,
):
    """slime's forward_only and train_one_step on this rank; ``dynamic=False``: with the flag off
    and slime's own schedule (to compare a patched tree with the stock one); ``slimes_own``: with
    the flag on and ``--use-slime-dynamic-batch-size``, slime's own dynamic batching. ``replay``: None for
    the dense GPT; ``"r2"`` / ``"r3"``: the tiny MoE with ``--use-routing-replay`` /
    ``--use-rollout-routing-replay``, run in the order of slime's ``train_actor``.
    ``loss_fault``: slime's loss raises at its second call in training on the last stage of DP
    rank 1, whose process lives on (as its Ray actor would)."""
    import dataclasses

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from megatron_dynbatch.cpu.training_shim import apply_training_cpu_shim

    apply_training_cpu_shim()
    stubbed = _install_stubs()
    _import_slime(slime_root)
    from megatron.training.global_vars import set_args
    from slime.backends.megatron_utils import data as slime_data
    from slime.backends.megatron_utils import model as slime_model
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy

    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        make_schedule_config_safe,
        tiny_transformer_config,
        wrap_in_ddp,
    )

    assert slime_model.__file__.startswith(slime_root), slime_model.__file__
    _use_cpu_accelerator()
    pp = ps.get_pipeline_model_parallel_world_size()
    dp = ps.get_data_parallel_world_size()
    dp_rank = ps.get_data_parallel_rank()
    cp = ps.get_context_parallel_world_size()
    args = _slime_args(per_token, max_tokens, pp)
    args.use_dynamic_batch_size = dynamic
    if slimes_own:
        args.use_slime_dynamic_batch_size = True
    # What slime's validation leaves: our hook's path when ours runs.
    ours = args.use_dynamic_batch_size and not getattr(args, "use_slime_dynamic_batch_size", False)
    args.micro_batch_planner_path = HOOK_PATH if ours else None
    set_args(args)
    data = _rollout_batch(num_rollouts, routed_experts=replay == "r3")
    if bad_rank is not None and dp_rank == bad_rank:
        data["adv"] = [a.clone() for a in data["adv"]]
        for a, m in zip(data["adv"], data["loss_masks"], strict=True):
            if int(m.sum()):
                a[int(m.nonzero()[0])] = float("nan")
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    config = tiny_transformer_config(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        calculate_per_token_loss=per_token,
        **(MOE if replay else {}),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        context_parallel_size=cp,
    )
    # slime always runs Megatron with variable_seq_lengths (its arguments.py forces it); with
    # interleaving at pp = 2 that needs overlap_p2p_comm, Megatron-LM's default there.
    config = dataclasses.replace(
        config, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall"
    )
    make_schedule_config_safe(config)
    config.finalize_model_grads_func = finalize_model_grads
    if replay:
        _enable_routing_replay(args, replay)
    chunks = build_tiny_gpt(config, seed=SEED, attention=attention)
    if replay:
        _install_slime_router_hooks(chunks)
    ddp_chunks = wrap_in_ddp(chunks)
    model = [_thd_chunk(c, cp) for c in ddp_chunks]

    tp_config = {
        "dp_size": dp,
        "cp_size": cp,
        "vpp_size": vpp,
        # Megatron's default interleaving group: the pipeline size.
        "microbatch_group_size_per_vp_stage": pp if vpp > 1 else 1,
    }
    args.global_batch_size = gbs
    rollout_data = _rank_rollout_data(slime_root, args, tp_config, data, dp_rank)
    iterators = slime_data.get_data_iterator(rollout_data)
    if cp > 1:
        # What slime's compute_advantages_and_returns gives under CP (after get_data_iterator,
        # which adds a sample-less rank's phantom): this rank's zigzag share of each response.
        from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp

        rollout_data["advantages"] = [
            slice_log_prob_with_cp(a, t, r)
            for a, t, r in zip(
                rollout_data["advantages"],
                rollout_data["total_lengths"],
                rollout_data["response_lengths"],
                strict=True,
            )
        ]
    started = time.monotonic()
    stack = contextlib.ExitStack()
    from tests._support import RouterTokens

    router_tokens = RouterTokens()
    try:
        stack.enter_context(router_tokens.installed())
        if replay == "r3":
            _fill_routing_replay(slime_root, args, model, iterators, rollout_data)
        if replay:  # train_actor's stage for the actor's log-prob pass
            os.environ["ROUTING_REPLAY_STAGE"] = "replay_forward" if replay == "r3" else "record"
        outputs = slime_model.forward_only(
            get_log_probs_and_entropy, args, model, iterators, rollout_data["num_microbatches"]
        )
        log_probs = outputs.get("log_probs")  # None off the last stage
        holder = [None] * dist.get_world_size()
        dist.all_gather_object(holder, log_probs)
        last = [h for h in holder if h is not None]
        # Old log-probs of the policy loss: this rank's pipeline's last stage.
        group_lp = holder[ps.get_pipeline_model_parallel_last_rank()]
        rollout_data["log_probs"] = [lp.detach() for lp in group_lp]
        if replay == "r3":  # train_actor: the rollout's routing replays again in training
            from slime.utils.routing_replay import RoutingReplay

            RoutingReplay.clear_all_forward()
        if replay:
            os.environ["ROUTING_REPLAY_STAGE"] = "replay_backward"
        actor = None
        if estimator is not None:
            actor = _actor_path(slime_root, args, model, iterators, rollout_data, estimator)
        recorder = _Recorder(ddp_chunks)
        for it in iterators:
            it.reset()
        if loss_fault and ps.is_pipeline_last_stage(ignore_virtual=True) and dp_rank == 1:
            stack.callback(setattr, slime_model, "loss_function", slime_model.loss_function)
            slime_model.loss_function = _fails_at_second_call(slime_model.loss_function)
        router_tokens.active = True
        for step_id, (m, step_gbs) in enumerate(
            zip(rollout_data["num_microbatches"], rollout_data["global_batch_sizes"], strict=True)
        ):
            for chunk in ddp_chunks:
                chunk.zero_grad_buffer()
            slime_model.train_one_step(
                args, 0, step_id, iterators, model, recorder, recorder, m, step_gbs
            )
        router_tokens.active = False
        replays = _replay_counts() if replay else None
    except Exception as error:  # the fault case: every rank must fail the same way, quickly
        if bad_rank is None and not loss_fault:
            raise
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - started}
    finally:
        stack.close()
        if replay:
            _disable_routing_replay()
    return {
        "stubbed": stubbed,
        "router_tokens": router_tokens.per_layer,
        # Tokens of this rank's real samples (the phantom of a rank without samples is padding).
        "real_tokens": sum(
            int(n)
            for n, p in zip(rollout_data["total_lengths"], rollout_data["partition"], strict=True)
            if p >= 0
        ),
        "grads": recorder.steps,
        "increments": recorder.increments,
        # A rank without samples holds one phantom (rollout position -1) that trains nothing.
        "partition": [p for p in rollout_data["partition"] if p >= 0],
        "log_probs": [
            lp.clone()
            for lp, p in zip(
                _whole_responses(group_lp, rollout_data) if cp > 1 else group_lp,
                rollout_data["partition"],
                strict=True,
            )
            if p >= 0
        ],
        "num_microbatches": list(rollout_data["num_microbatches"]),
        "global_batch_sizes": list(rollout_data["global_batch_sizes"]),
        "placeholders_only": dp > 1 and rollout_data["partition"] == [-1],
        "num_placeholders": sum(1 for mb in rollout_data["micro_batch_indices"] if not mb),
        "row_lengths": list(getattr(iterators[0], "row_lengths", ())),
        "last_stage_outputs": len(last),
        "actor": actor,
        "replays": replays,
    }


def _fails_at_second_call(loss_function):
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("slime's loss failed at its second call")
        return loss_function(*args, **kwargs)

    return failing


def _whole_responses(local, rollout_data):
    """Per-sample response values held per CP rank (slime's zigzag slices), made whole again
    from every CP rank's share (to compare with a reference run without CP)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp

    totals, responses = rollout_data["total_lengths"], rollout_data["response_lengths"]
    positions = [
        slice_log_prob_with_cp(torch.arange(r), t, r)
        for t, r in zip(totals, responses, strict=True)
    ]
    group = ps.get_context_parallel_group()
    shares = [None] * dist.get_world_size(group)
    dist.all_gather_object(
        shares, [(p, v.detach()) for p, v in zip(positions, local, strict=True)], group=group
    )
    whole = [torch.full((r,), float("nan")) for r in responses]
    for share in shares:
        for full, (where, values) in zip(whole, share, strict=True):
            full[where] = values.to(full.dtype)
    assert all(bool(torch.isfinite(w).all()) for w in whole), "a response position was lost"
    return whole


def _actor_path(slime_root, args, model, iterators, rollout_data, estimator):
    """What slime's ``MegatronTrainRayActor.train_actor`` runs between the log-prob pass and
    training, in its order: the reference model's log-probs (``forward_only`` with ``ref_``), the
    critic's values (ppo; given as zeros, as the critic would ship them), slime's own
    ``compute_advantages_and_returns`` (KL against the reference, advantage whitening over DP),
    then the metric logging the patched actor calls. Returns this rank's advantages by rollout
    position and the metrics slime reduced (on the DP source rank)."""
    from megatron.core import parallel_state as ps
    from slime.backends.megatron_utils import model as slime_model
    from slime.backends.megatron_utils.loss import (
        compute_advantages_and_returns,
        get_log_probs_and_entropy,
    )
    from slime.observability import logging_utils

    from megatron_dynbatch.integrations.slime import empty_rank

    actor_source = (pathlib.Path(slime_root) / "slime/backends/megatron_utils/actor.py").read_text()
    # Patch 0006: what train_actor runs just before slime's log_rollout_data.
    assert "mute_phantom_metrics(rollout_data)" in actor_source
    for name, value in dict(
        advantage_estimator=estimator,
        kl_coef=0.05,
        kl_loss_type="low_var_kl",
        normalize_advantages=True,
        custom_advantage_function_path=None,
        gamma=1.0,
        lambd=0.95,
        use_opd=False,
        use_critic=estimator == "ppo",
        log_multi_turn=False,
        log_passrate=False,
        log_correct_samples=False,
        use_wandb=False,
        use_tensorboard=False,
        wandb_always_use_train_step=False,
    ).items():
        setattr(args, name, value)
    rollout_data.update(
        slime_model.forward_only(
            get_log_probs_and_entropy,
            args,
            model,
            iterators,
            rollout_data["num_microbatches"],
            store_prefix="ref_",
        )
    )
    # slime gathers metrics over Megatron's gloo DP group; the CPU workers build their groups on
    # gloo without the extra copies, so the DP group itself is that group here.
    ps.get_data_parallel_group_gloo = lambda with_context_parallel=False: (
        ps.get_data_parallel_group(with_context_parallel=with_context_parallel)
    )
    last = ps.is_pipeline_last_stage()
    if estimator == "ppo" and last:
        rollout_data["values"] = [torch.zeros(int(r)) for r in rollout_data["response_lengths"]]
    compute_advantages_and_returns(args, rollout_data)
    logged = []
    logging_utils.log = lambda args, metrics, step_key: logged.append(dict(metrics))
    from slime.observability import train_metric_utils

    empty_rank.mute_phantom_metrics(rollout_data)
    train_metric_utils.log_rollout_data(0, args, rollout_data)
    advantages = {}
    if last:
        for position, adv in zip(
            rollout_data["partition"], rollout_data["advantages"], strict=True
        ):
            if position >= 0:
                advantages[position] = adv.detach().clone()
    return {"advantages": advantages, "metrics": logged}


class _ForcedTopk:
    """A router's top-k replaced by given experts (the reference of R3: the rollout's routing,
    one sample at a time); probabilities are the router's own scores at those experts."""

    indices = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, compute_topk=None):
        assert self.indices.shape == (scores.shape[0], topk), (self.indices.shape, scores.shape)
        return scores.gather(1, self.indices), self.indices


def _reference_body(num_rollouts, gbs, max_tokens, per_token, replay=None, attention=True):
    """Each sample alone through a single-process tiny GPT: per-step gradients, log-probs.
    ``replay``: the tiny MoE; with ``"r3"`` every sample is routed to its rollout experts."""
    from megatron_dynbatch.adapters.slime import build_dp_schedule
    from megatron_dynbatch.mcore.forward import build_attention_mask
    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        named_global_grads,
        tiny_transformer_config,
    )

    data = _rollout_batch(num_rollouts, routed_experts=replay == "r3")
    config = tiny_transformer_config(calculate_per_token_loss=per_token, **(MOE if replay else {}))
    [model] = build_tiny_gpt(config, seed=SEED, attention=attention)
    routers = _routers([model]) if replay == "r3" else []
    for router in routers:
        router.router_replay = _ForcedTopk()
    args = _slime_args(per_token, max_tokens, 1)
    lengths = [len(t) for t in data["tokens"]]
    plan = build_dp_schedule(
        args,
        {"dp_size": 1, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1},
        lengths,
        global_batch_size=gbs,
        rollout_indices=data["rollout_ids"],
    ).plan

    def response_log_probs(i):
        tokens = data["tokens"][i]
        length = tokens.numel()
        response = data["response_lengths"][i]
        for layer, router in enumerate(routers):
            # The last token's routing reaches no scored position (causal attention); any
            # distinct experts do.
            last = torch.arange(MOE["moe_router_topk"]).unsqueeze(0)
            experts = data["routed_experts"][i][:, layer].to(torch.long)
            router.router_replay.indices = torch.cat([experts, last])
        logits = model(
            tokens.unsqueeze(0),
            torch.arange(length).unsqueeze(0),
            build_attention_mask(torch.zeros(1, length, dtype=torch.int64)),
        )[0]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        scored = log_probs[length - response - 1 : length - 1]
        return scored.gather(1, tokens[length - response :].unsqueeze(1)).squeeze(1)

    all_log_probs = []
    with torch.no_grad():
        for i in range(len(lengths)):
            all_log_probs.append(response_log_probs(i))
    step_grads = []
    for step in plan.steps:
        model.zero_grad()
        samples = step.sample_indices()
        total = 0.0
        for i in samples:
            mask = data["loss_masks"][i].float()
            lp = response_log_probs(i)
            # PPO at ratio 1: d/dθ of -A * exp(lp - lp_old) is -A * dlp.
            per_token_loss = -data["adv"][i] * torch.exp(lp - lp.detach())
            summed = (per_token_loss * mask).sum()
            if per_token:
                total = total + summed
            else:
                total = total + summed / max(data["rollout_mask_sums"][i], 1)
        if per_token:
            denominator = sum(float(data["loss_masks"][i].sum()) for i in samples)
        else:
            denominator = step.num_rollouts
        (total / denominator).backward()
        step_grads.append(named_global_grads([model]))
    return {"grads": step_grads, "log_probs": all_log_probs, "num_samples": len(lengths)}


def _compare_with_reference(results, reference):
    """Every step's gradients (relative) and every sample's log-probs (absolute) against the
    per-sample reference, both within 1e-5; returns (steps, worst gradient, worst log-prob)."""
    num_steps = len(reference["grads"])
    assert all(len(r["grads"]) == num_steps for r in results)
    worst = 0.0
    for s in range(num_steps):
        merged = {}
        for r in results:
            merged.update(r["grads"][s])  # DP ranks hold the same reduced gradients
        assert set(merged) == set(reference["grads"][s])
        for name, ref in reference["grads"][s].items():
            err = relative_error(merged[name], ref)
            worst = max(worst, err)
            assert err <= REL_TOL, (s, name, err)
    # Log-probs in rollout order: each DP rank's local order is its partition.
    worst_lp = 0.0
    for r in results:
        for position, lp in zip(r["partition"], r["log_probs"], strict=True):
            want = reference["log_probs"][position]
            assert lp.shape == want.shape
            worst_lp = max(worst_lp, float((lp - want).abs().max()))
    assert worst_lp <= 1e-5
    return num_steps, worst, worst_lp


CASES = [
    # (world, layout, rollouts, gbs, max_tokens, per_token)
    pytest.param(2, Layout(pp=2), 7, 3, 64, True, id="pp2-dp1-token-mean-3-steps"),
    pytest.param(4, Layout(pp=2), 7, 3, 64, True, id="pp2-dp2-token-mean-3-steps"),
    pytest.param(4, Layout(pp=2), 7, 7, 64, False, id="pp2-dp2-rollout-mean"),
    pytest.param(4, Layout(pp=2), 1, 1, 64, True, id="pp2-dp2-one-rank-only-placeholders"),
    pytest.param(2, Layout(pp=2, vpp=2), 7, 3, 64, True, id="pp2-vpp2-token-mean-3-steps"),
]


@needs_slime
@pytest.mark.parametrize("world, layout, rollouts, gbs, max_tokens, per_token", CASES)
def test_slime_train_one_step_and_forward_only_match_reference(
    patched_slime, world, layout, rollouts, gbs, max_tokens, per_token
):
    started = time.monotonic()
    results = run_on_ranks(
        world, _slime_body, patched_slime, rollouts, gbs, max_tokens, per_token, layout=layout
    )
    wall = time.monotonic() - started
    [reference] = run_on_ranks(
        1, _reference_body, rollouts, gbs, max_tokens, per_token, layout=Layout()
    )
    pp = layout.pp
    dp = world // pp
    num_steps, worst, worst_lp = _compare_with_reference(results, reference)
    # Scheduler increments: the rollouts each step really trained.
    assert results[0]["increments"] == results[0]["global_batch_sizes"]
    # Every sample trained: the DP ranks' partitions (each held by its pp stages) cover them all.
    partitions = {tuple(r["partition"]) for r in results}
    assert sorted(p for part in partitions for p in part) == list(range(reference["num_samples"]))
    if rollouts == 1:
        assert any(r["placeholders_only"] for r in results)
    else:
        # slime exchanges shapes: each micro-batch ran its own row (DPSchedule.row_lengths).
        rows = [row for r in results for row in r["row_lengths"]]
        assert len(set(rows)) > 1, rows
    print(
        f"\n[slime {layout} dp={dp}] steps={num_steps} counts={results[0]['num_microbatches']} "
        f"gbs={results[0]['global_batch_sizes']} grad rel diff max={worst:.2e} log-prob abs diff "
        f"max={worst_lp:.2e} wall={wall:.1f}s stubbed={results[0]['stubbed']}"
    )


CP_CASES = [
    # (world, layout, rollouts, gbs, per_token); dp = world / cp
    pytest.param(2, Layout(cp=2), 7, 3, True, id="cp2-dp1-token-mean"),
    pytest.param(4, Layout(cp=2), 7, 3, True, id="cp2-dp2-token-mean"),
    pytest.param(4, Layout(cp=2), 7, 3, False, id="cp2-dp2-rollout-mean"),
    pytest.param(4, Layout(cp=2), 1, 1, True, id="cp2-dp2-one-rank-only-placeholders"),
]


@needs_slime
@pytest.mark.parametrize("world, layout, rollouts, gbs, per_token", CP_CASES)
def test_context_parallel_matches_reference(patched_slime, world, layout, rollouts, gbs, per_token):
    """``--context-parallel-size 2`` through slime: get_batch's zigzag split of every sample and
    placeholder, the per-CP-rank log-probs and advantages slime keeps, the step agreement's
    checks of them, our loss (slime's CP reducer, loss x cp, the full token count) and Megatron's
    gradient reduction over DP x CP. The CPU's local attention cannot split a sequence, so the
    tiny GPT here has layers without attention (embedding, norms, MLP, output: per-token work,
    which CP splits exactly); gradients and log-probs equal the per-sample reference of the same
    model without CP."""
    results = run_on_ranks(
        world,
        _slime_body,
        patched_slime,
        rollouts,
        gbs,
        64,
        per_token,
        attention=False,
        layout=layout,
    )
    [reference] = run_on_ranks(
        1, _reference_body, rollouts, gbs, 64, per_token, attention=False, layout=Layout()
    )
    num_steps, worst, worst_lp = _compare_with_reference(results, reference)
    partitions = {tuple(r["partition"]) for r in results}
    assert sorted(p for part in partitions for p in part) == list(range(reference["num_samples"]))
    if rollouts == 1:
        assert any(r["placeholders_only"] for r in results)
    print(
        f"\n[slime cp=2 dp={world // 2}] steps={num_steps} grad rel diff max={worst:.2e} "
        f"log-prob abs diff max={worst_lp:.2e}"
    )


MOE_CASES = [
    # (replay, rollouts, gbs, layout); 4 ranks, dp = 4 / pp
    pytest.param("r2", 7, 3, Layout(pp=2), id="r2-pp2-dp2-3-steps"),
    pytest.param("r3", 7, 3, Layout(pp=2), id="r3-pp2-dp2-3-steps"),
    pytest.param("r3", 1, 1, Layout(pp=2), id="r3-pp2-dp2-one-rank-only-placeholders"),
    pytest.param("r2", 7, 3, Layout(pp=2, ep=2), id="r2-pp2-dp2-ep2"),
    pytest.param("r3", 7, 3, Layout(pp=2, ep=2), id="r3-pp2-dp2-ep2"),
    pytest.param("r3", 1, 1, Layout(pp=2, ep=2), id="r3-pp2-dp2-ep2-one-rank-only-placeholders"),
    pytest.param("r2", 7, 3, Layout(pp=2, vpp=2), id="r2-pp2-vpp2-dp2"),
    pytest.param("r3", 7, 3, Layout(pp=2, vpp=2), id="r3-pp2-vpp2-dp2"),
]


@needs_slime
@pytest.mark.parametrize("replay, rollouts, gbs, layout", MOE_CASES)
def test_moe_routing_replay_matches_reference(patched_slime, replay, rollouts, gbs, layout):
    """A tiny MoE (4 layers, 4 experts, top-2) on 4 ranks at pp 2 (dp 2), with expert parallel
    size 2 (the all-to-all spans the two DP ranks) and with interleaving, through slime with
    ``--use-routing-replay`` (R2: the log-prob pass records routing, training replays it) or
    ``--use-rollout-routing-replay`` (R3: the rollout's experts, padded to each step's row by
    patch 0008, replay in the log-prob pass and in training). Gradients and log-probs equal the
    per-sample reference (R2: the model's own routing; R3: the rollout's experts); every recorded
    routing, placeholder micro-batches' and the phantom's included, is replayed exactly once in
    training."""
    started = time.monotonic()
    results = run_on_ranks(
        4, _slime_body, patched_slime, rollouts, gbs, 64, True, replay=replay, layout=layout
    )
    wall = time.monotonic() - started
    [reference] = run_on_ranks(
        1, _reference_body, rollouts, gbs, 64, True, replay=replay, layout=Layout()
    )
    num_steps, worst, worst_lp = _compare_with_reference(results, reference)
    if rollouts == 1:  # one DP rank holds the phantom sample and placeholders only
        assert any(r["placeholders_only"] for r in results)
    else:
        assert num_steps >= 2
        # The layout has placeholder micro-batches, whose routing is recorded and replayed too.
        assert any(r["num_placeholders"] for r in results)
    for r in results:
        total = sum(r["num_microbatches"])
        # One RoutingReplay per router: the rank's share of the layers (every chunk's).
        assert r["replays"] == [(total, total)] * (MOE["num_layers"] // layout.pp), r["replays"]
        # Patch 0009: in training, every router of the rank counts exactly the tokens of its real
        # samples, over all steps; no padding, placeholder or phantom token.
        layers = r["router_tokens"]
        assert len(layers) == MOE["num_layers"] // layout.pp, layers
        assert all(count == r["real_tokens"] for count in layers.values()), (
            layers,
            r["real_tokens"],
        )
    print(
        f"\n[slime MoE {replay} {layout} rollouts={rollouts}] steps={num_steps} "
        f"counts={results[0]['num_microbatches']} "
        f"placeholders={[r['num_placeholders'] for r in results]} grad rel diff max={worst:.2e} "
        f"log-prob abs diff max={worst_lp:.2e} wall={wall:.1f}s"
    )


ESTIMATORS = ["grpo", "gspo", "cispo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]


@needs_slime
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_a_rank_without_samples_passes_slimes_actor_path_contributing_nothing(
    patched_slime, estimator
):
    """One rollout on two DP ranks: one rank holds only placeholders (and the phantom). It runs
    slime's advantages (with KL and whitening over DP), metric logging and training in step with
    its peer, and changes nothing: advantages, gradients and metrics equal the one-rank run's."""
    runs = {
        dp: run_on_ranks(
            2 * dp,
            _slime_body,
            patched_slime,
            1,
            1,
            64,
            True,
            estimator=estimator,
            layout=Layout(pp=2),
        )
        for dp in (1, 2)
    }
    alone, shared = runs[1], runs[2]
    assert any(r["placeholders_only"] for r in shared)
    want_adv = {p: a for r in alone for p, a in r["actor"]["advantages"].items()}
    got_adv = {p: a for r in shared for p, a in r["actor"]["advantages"].items()}
    assert want_adv and got_adv.keys() == want_adv.keys()
    for position, adv in want_adv.items():
        assert torch.allclose(got_adv[position], adv, rtol=1e-5, atol=1e-6), position
    worst = 0.0
    assert len(alone[0]["grads"]) == len(shared[0]["grads"]) >= 1
    for step in range(len(alone[0]["grads"])):
        want, got = {}, {}
        for r in alone:
            want.update(r["grads"][step])  # pipeline stages hold disjoint parameters
        for r in shared:
            got.update(r["grads"][step])
        assert got.keys() == want.keys()
        assert sum(float(g.norm()) for g in want.values()) > 0  # the step really trained
        for name, grad in want.items():
            worst = max(worst, relative_error(got[name], grad))
    assert worst <= REL_TOL, worst
    [want_metrics] = [m for r in alone for m in r["actor"]["metrics"]]
    [got_metrics] = [m for r in shared for m in r["actor"]["metrics"]]
    assert got_metrics.keys() == want_metrics.keys()
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    print(
        f"\n[slime actor {estimator}] dp 2 vs 1: grad rel diff max={worst:.2e}, "
        f"{len(want_metrics)} metrics equal"
    )


@needs_slime
def test_bad_sample_on_one_rank_stops_every_rank_quickly(patched_slime):
    results = run_on_ranks(4, _slime_body, patched_slime, 7, 7, 64, True, 1, layout=Layout(pp=2))
    messages = {r["error"] for r in results}
    assert len(messages) == 1, messages
    [message] = messages
    assert "StepAgreementError" in message and "is not finite" in message
    assert max(r["seconds"] for r in results) < FAIL_FAST_S


@needs_slime
def test_a_loss_error_inside_the_schedule_on_a_living_rank_stops_every_rank_with_it(patched_slime):
    """pp 2 x dp 2: slime's loss raises on one last stage; its pipeline peer waited for a
    gradient and the other pipeline in DDP's all-reduce until the process-group timeout."""
    results = run_on_ranks(
        4, _slime_body, patched_slime, 7, 7, 64, True, loss_fault=True, layout=Layout(pp=2)
    )
    messages = {r.get("error") for r in results}
    assert len(messages) == 1 and None not in messages, results
    [message] = messages
    assert message.startswith(
        "StepAgreementError: dynamic batching stopped on every rank (slime "
        "training step 0) inside Megatron's schedule"
    ), message
    assert "1 of 4 rank(s) failed: rank 3: micro-batch 1, loss: ValueError: slime's loss" in message
    assert message.endswith("; slime stops the step before its optimizer step"), message
    assert max(r["seconds"] for r in results) < FAIL_FAST_S


@needs_slime
def test_with_the_flag_off_patched_slime_trains_exactly_like_stock_slime(
    stock_slime, patched_slime
):
    """Every patched line runs only with --use-dynamic-batch-size: with it off, the patched tree
    and the stock checkout give bitwise the same log-probs and gradients (slime's own schedule)."""
    runs = {
        name: run_on_ranks(2, _slime_body, root, 7, 3, 64, True, dynamic=False, layout=Layout(pp=2))
        for name, root in (("patched", patched_slime), ("stock", stock_slime))
    }
    patched, stock = runs["patched"], runs["stock"]
    assert patched[0]["num_microbatches"] == stock[0]["num_microbatches"]
    for mine, theirs in zip(patched, stock, strict=True):
        assert len(mine["grads"]) == len(theirs["grads"]) >= 2
        for step_mine, step_theirs in zip(mine["grads"], theirs["grads"], strict=True):
            assert step_mine.keys() == step_theirs.keys()
            for name, grad in step_mine.items():
                assert torch.equal(grad, step_theirs[name]), name
        for lp_mine, lp_theirs in zip(mine["log_probs"], theirs["log_probs"], strict=True):
            assert torch.equal(lp_mine, lp_theirs)


def _stock_script_argv(script):
    """The flags of one of slime's own ``scripts/run-*.sh`` (values with shell variables left out:
    this parser only needs what it can read)."""
    argv = []
    for line in script.read_text().splitlines():
        words = line.strip().rstrip("\\").split()
        # Flags only: not ``--`` (the end of ray job submit's own options) nor shell variables.
        if not words or not re.fullmatch(r"--[a-z][\w-]*", words[0]):
            continue
        if any("$" in w for w in words):
            continue
        argv += words[:2] if len(words) > 1 and not words[1].startswith("--") else words[:1]
    return argv


def _parse_body(slime_root, argv):
    """slime's own (patched) argument parser on ``argv``: the dynamic-batch settings it gives."""
    import argparse

    _install_stubs()
    _import_slime(slime_root)
    from slime.utils.arguments import get_slime_extra_args_provider

    parser = argparse.ArgumentParser()
    get_slime_extra_args_provider()(parser)
    args, _ = parser.parse_known_args(argv)
    return {
        key: getattr(args, key, None)
        for key in ("use_dynamic_batch_size", "max_tokens_per_gpu", "use_slime_dynamic_batch_size")
    }


@needs_slime
def test_the_way_back_runs_slimes_own_dynamic_batching_bitwise(stock_slime, patched_slime):
    """A stock ``scripts/run-*.sh`` argument set (it sets --use-dynamic-batch-size) plus
    --use-slime-dynamic-batch-size on the patched tree: slime's own dynamic batching, log-probs
    and gradients bitwise the unpatched checkout's with --use-dynamic-batch-size, on the test the
    flag-off check uses (pp 2, dp 1)."""
    script = pathlib.Path(SLIME_DIR) / "scripts" / "run-qwen3-4B.sh"
    argv = _stock_script_argv(script)
    assert "--use-dynamic-batch-size" in argv, argv
    [parsed] = run_on_ranks(
        1, _parse_body, patched_slime, argv + ["--use-slime-dynamic-batch-size"], layout=Layout()
    )
    assert parsed["use_dynamic_batch_size"] and parsed["use_slime_dynamic_batch_size"], parsed
    assert parsed["max_tokens_per_gpu"] == 9216, parsed
    [default] = run_on_ranks(1, _parse_body, patched_slime, argv, layout=Layout())
    assert default["use_slime_dynamic_batch_size"] is False, default

    runs = {
        name: run_on_ranks(
            2, _slime_body, root, 7, 3, 64, True, slimes_own=own, layout=Layout(pp=2)
        )
        for name, root, own in (("patched", patched_slime, True), ("stock", stock_slime, False))
    }
    patched, stock = runs["patched"], runs["stock"]
    assert patched[0]["num_microbatches"] == stock[0]["num_microbatches"]
    for mine, theirs in zip(patched, stock, strict=True):
        assert len(mine["grads"]) == len(theirs["grads"]) >= 2
        for step_mine, step_theirs in zip(mine["grads"], theirs["grads"], strict=True):
            assert step_mine.keys() == step_theirs.keys()
            for name, grad in step_mine.items():
                assert torch.equal(grad, step_theirs[name]), name
        for lp_mine, lp_theirs in zip(mine["log_probs"], theirs["log_probs"], strict=True):
            assert torch.equal(lp_mine, lp_theirs)
    # The way back is a different schedule from ours (else the check above would prove nothing).
    [ours] = [run_on_ranks(2, _slime_body, patched_slime, 7, 3, 64, True, layout=Layout(pp=2))]
    assert ours[0]["num_microbatches"] != stock[0]["num_microbatches"] or any(
        not torch.equal(g, stock[0]["grads"][0][n]) for n, g in ours[0]["grads"][0].items()
    )


def test_placeholder_carries_r3_routed_experts_with_the_real_shape():
    data = _local_data()
    data["rollout_routed_experts"] = [
        torch.randint(0, 8, (5, 3, 2)),
        torch.randint(0, 8, (3, 3, 2)),
    ]
    sample = placeholder_sample(data, ["tokens", "rollout_routed_experts"], 16)
    experts = sample["rollout_routed_experts"]
    # slime's prepare_routed_experts_for_routing_replay wants tokens - 1 rows of [layers, topk].
    assert experts.shape == (15, 3, 2) and experts.dtype == data["rollout_routed_experts"][0].dtype
    assert experts[:, :, 0].eq(0).all() and experts[:, :, 1].eq(1).all()
