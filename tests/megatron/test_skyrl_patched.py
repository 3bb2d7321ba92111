"""SkyRL's own Megatron worker code, patched by ``patches/skyrl``, against a per-sample reference.

With ``SKYRL_DIR`` (a SkyRL checkout at the commit named in ``patches/skyrl/README.md``) the
patches are applied to a copy with ``launch/apply_skyrl_patches.sh``; on gloo CPU ranks (tiny GPT,
pp 2 at dp 1 and 2, pp 2 x vpp 2) SkyRL's real ``MegatronModelWrapper`` (``forward`` and
``forward_backward_mini_batch``, its ``ppo_policy_loss``, ``remove_left_padding``, log-prob code)
runs under the worker's real ``_forward_logprobs``, ``_reorder_megatron_forward_output``,
``_pad_microbatch_to_size`` and ``forward_backward`` (lifted from the patched
``megatron_worker.py``). Advantages are pre-scaled by SkyRL's own
``apply_loss_reduction_to_advantages_minibatch`` over the whole mini-batch, then the mini-batch is
padded to a multiple of dp by SkyRL's own ``pad_training_input_batch`` and sharded over the DP
ranks as SkyRL's dispatch does (contiguous chunks). Checked: gradients equal
a single process running each sample alone (relative 1e-5), log-probs come back in sample order
(absolute 1e-5), and so do the training pass's per-sample ``loss_fn_outputs``, for token-mean,
sequence-mean and prompt-mean, a step-wise (multi-turn) batch, prompt-aligned step-wise
mini-batches (SkyRL #1483, its own ``compute_prompt_mini_batch_boundaries``), a step with fewer
samples than DP ranks (one rank holds only SkyRL's loss-masked pad copy) and one where a rank gets
no row at all; with the flag off the patched tree is bitwise the stock one, and patch 0003 (a
SkyRL fix) lets SkyRL's stock batching run virtual pipeline stages. SkyRL's own CPU unit tests of
its batching run on the patched tree.

What is not SkyRL's in these runs, and why:

* modules SkyRL imports that are not installed here and need Ray, a GPU or downloads are stubbed:
  ``ray`` (``remote`` an identity, ``is_initialized`` False), ``vllm``, ``transformers``,
  ``datasets``, ``cloudpathlib``, ``pydantic``, ``skyrl_gym``, ``megatron.bridge``,
  ``huggingface_hub``, and for ``validate_cfg``'s imports ``aiohttp``, ``pybase64``,
  ``zstandard``, ``safetensors``, ``rich`` (:data:`STUBBED`; only those missing are stubbed);
* the worker class: its methods above are lifted from the patched source and bound to a small
  host object, because ``MegatronPolicyWorkerBase.__init__`` builds the model through Megatron
  Bridge from a Hugging Face checkpoint and runs as a Ray actor;
* the model is the tiny GPT of ``megatron_dynbatch.tools.testing`` behind a chunk that gives it
  a causal mask (SkyRL hands Transformer Engine a padding mask; real tokens come first after its
  ``remove_left_padding``, so causal is the same attention); ``remove_microbatch_padding`` (THD)
  is off because THD attention needs Transformer Engine;
* the wrapper's ``_copy_tensor_dict_to_device`` (a move to ``torch.cuda.current_device()``) is an
  identity: the tensors are on the CPU already;
* the worker's ``strategy.all_reduce`` of the metrics is a gloo stand-in (SkyRL's moves each
  value to CUDA) that also checks that every DP rank reduces the same keys;
* SkyRL's ``_defer_finalize_model_grads`` runs as in SkyRL: the test calls the wrapper's
  ``run_pending_grad_sync`` where ``optim_step`` would.

Without ``SKYRL_DIR`` these tests are skipped (the drop-in is tested in
``tests/unit/test_skyrl_plan.py``).
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

apply_cpu_shim()

from megatron_dynbatch.tools.testing.workers import (  # noqa: E402
    DistributedTestError,
    Layout,
    run_on_ranks,
)
from tests._support import (  # noqa: E402
    QWEN2_05B_HF,
    SMALL_MOE_HF,
    host_patches,
    patched_copy,
    relative_error,
    stock_copy,
)

pytestmark = pytest.mark.skyrl

REPO = pathlib.Path(__file__).resolve().parents[2]
APPLY = REPO / "launch" / "apply_skyrl_patches.sh"
SKYRL_DIR = os.environ.get("SKYRL_DIR")
REL_TOL = 1e-5
#: SkyRL's import chain is slow on a loaded 2-core machine (minutes); the pool's default is 180 s.
BODY_TIMEOUT_S = 600
SEED = 11
VOCAB = 128
WORKER = pathlib.Path("skyrl/backends/skyrl_train/workers/megatron/megatron_worker.py")
#: Modules SkyRL imports that need Ray, a GPU or downloads; stubbed when not installed.
STUBBED = (
    "ray",
    "vllm",
    "transformers",
    "datasets",
    "cloudpathlib",
    "pydantic",
    "skyrl_gym",
    "huggingface_hub",
    "aiohttp",
    "pybase64",
    "zstandard",
    "safetensors",
    "rich",
)
#: Worker methods lifted from the patched megatron_worker.py (the real code that runs).
LIFTED = (
    "_forward_logprobs",
    "_reorder_megatron_forward_output",
    "_pad_microbatch_to_size",
    "_drop_pixel_values_on_non_first_pp_stage",
    "forward_backward",
)

needs_skyrl = pytest.mark.skipif(
    not SKYRL_DIR,
    reason="SKYRL_DIR is not set: point it at a SkyRL checkout (commit in "
    "patches/skyrl/README.md) to run SkyRL's Megatron worker code with the patches applied",
)


PATCHES = host_patches("skyrl")


@pytest.fixture(scope="module")
def stock_skyrl(tmp_path_factory):
    """A pristine copy of SKYRL_DIR's ``skyrl/`` (our patches reverse-applied if it holds them)."""
    return stock_copy(SKYRL_DIR, "skyrl", tmp_path_factory.mktemp("skyrl_stock"))


@pytest.fixture(scope="module")
def patched_skyrl(tmp_path_factory, stock_skyrl):
    """The stock copy with our patches applied by ``launch/apply_skyrl_patches.sh``."""
    return patched_copy(stock_skyrl, "skyrl", tmp_path_factory.mktemp("skyrl_patched"))


@needs_skyrl
def test_apply_is_idempotent_and_refuses_other_trees(tmp_path, stock_skyrl, patched_skyrl):
    again = subprocess.run(["bash", str(APPLY), patched_skyrl], capture_output=True, text=True)
    assert again.returncode == 0 and "already applied" in again.stdout
    shutil.copytree(pathlib.Path(stock_skyrl) / "skyrl", tmp_path / "skyrl")
    worker = tmp_path / WORKER
    # Another SkyRL: a context line of patch 0002 differs.
    worker.write_text(
        worker.read_text().replace(
            '        log_probs = output["output"]  # shape: [total_padded_samples, num_actions]\n',
            '        log_probs = output["output"]\n',
        )
    )
    before = {p: p.read_bytes() for p in (tmp_path / "skyrl").rglob("*.py")}
    refused = subprocess.run(["bash", str(APPLY), str(tmp_path)], capture_output=True, text=True)
    assert refused.returncode == 1 and "nothing was changed" in refused.stderr
    assert before == {p: p.read_bytes() for p in (tmp_path / "skyrl").rglob("*.py")}


#: SkyRL's own CPU unit tests of its micro-batching (worker_utils, TrainingInputBatch and its dp
#: padding, the prompt-aligned mini-batch boundaries of #1483), run on the patched tree: the
#: patches must leave them passing.
SKYRL_OWN_TESTS = (
    "tests/backends/skyrl_train/test_token_based_batching_utils.py",
    "tests/backends/skyrl_train/test_train_batch.py",
    "tests/train/test_prompt_mini_batch.py",
)
#: Deselected: it round-trips a batch through a real Ray object store (Ray is stubbed here).
SKYRL_OWN_DESELECTED = (
    "tests/backends/skyrl_train/test_train_batch.py::test_train_batch_ray_serialization",
)


@needs_skyrl
def test_skyrls_own_batching_unit_tests_pass_on_the_patched_tree(tmp_path, patched_skyrl):
    # A copy of the patched tree with SkyRL's tests beside it (the shared patched tree gets no
    # top-level ``tests``: on the path of a later rank it would shadow this repository's).
    root = tmp_path / "tree"
    shutil.copytree(pathlib.Path(patched_skyrl) / "skyrl", root / "skyrl")
    shutil.copytree(pathlib.Path(SKYRL_DIR) / "tests", root / "tests")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    args = ["-q", "-p", "no:cacheprovider", "-c", str(tmp_path / "pytest.ini")]
    args += ["--rootdir", str(root), *(str(root / f) for f in SKYRL_OWN_TESTS)]
    args += [f"--deselect={f}" for f in SKYRL_OWN_DESELECTED]  # node ids, from the rootdir
    # This module is loaded by path under another name: SkyRL's tests import their own
    # top-level ``tests`` package, which this repository's ``tests`` would shadow.
    # It imports this repository's tests._support first (REPO first on the path for that import
    # only), then forgets our ``tests`` so that SkyRL's own tests import theirs.
    code = (
        f"import importlib.util, sys; sys.path.insert(0, {str(REPO)!r}); "
        f"spec = importlib.util.spec_from_file_location('_skyrl_stubs', {__file__!r}); "
        "helpers = importlib.util.module_from_spec(spec); spec.loader.exec_module(helpers); "
        "[sys.modules.pop(k) for k in list(sys.modules) if k.split('.')[0] == 'tests']; "
        "sys.path.pop(0); "
        f"helpers._install_stubs(); helpers._import_skyrl({str(root)!r}); import pytest; "
        f"sys.exit(pytest.main({args!r}))"
    )
    # megatron_dynbatch from this checkout; the working directory (SkyRL's) stays first.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=root,
        env=dict(os.environ, PYTHONPATH=path),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "failed" not in summary and "error" not in summary, summary
    print("\n[SkyRL's own tests on the patched tree] " + summary)


# -- running SkyRL's code on a rank -------------------------------------------------------------


def _install_stubs():
    """Stand-ins for the STUBBED modules (and Megatron Bridge) that are not installed; returns
    every module this process answers with a stand-in (the shared harness,
    ``megatron_dynbatch.tools.testing.host_stubs``)."""
    from megatron_dynbatch.tools.testing.host_stubs import install_stubs

    # megatron.bridge (Megatron Bridge: HF checkpoint conversion) is a separate distribution.
    # pydantic may be installed (NeMo-RL's tests need it), but on Python < 3.12 it refuses SkyRL's
    # typing.TypedDict models at import; SkyRL's Megatron worker path uses none of them.
    replace = ("pydantic",) if sys.version_info < (3, 12) else ()
    return install_stubs(STUBBED, prefixes=("megatron.bridge",), replace=replace)


_SKYRL_ROOTS = set()


def _import_skyrl(skyrl_root):
    """Put ``skyrl_root`` first on ``sys.path`` and forget a SkyRL imported from another root."""
    import sys

    for name in [n for n in sys.modules if n == "skyrl" or n.startswith("skyrl.")]:
        del sys.modules[name]
    sys.path[:] = [p for p in sys.path if p not in _SKYRL_ROOTS]
    _SKYRL_ROOTS.add(skyrl_root)
    sys.path.insert(0, skyrl_root)


def _lifted_worker_class(skyrl_root):
    """A class whose methods are the LIFTED ones, compiled from the (patched) worker source in a
    namespace holding that module's own imports."""
    import ast

    path = pathlib.Path(skyrl_root) / WORKER
    tree = ast.parse(path.read_text())
    namespace = {"__name__": "skyrl_worker_lifted"}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            try:
                exec(
                    compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace
                )
            except ImportError:
                # Checkpointing / weight-sync imports this megatron-core lacks; the lifted
                # methods do not use them (a name they did use would fail loudly at the call).
                pass
    methods = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        if cls.name not in ("MegatronWorker", "MegatronPolicyWorkerBase"):
            continue
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name in LIFTED:
                methods[fn.name] = fn
    assert set(methods) == set(LIFTED), sorted(methods)
    body = ast.ClassDef(
        name="LiftedMegatronWorker",
        bases=[],
        keywords=[],
        body=list(methods.values()),
        decorator_list=[],
        type_params=[],
    )
    module = ast.fix_missing_locations(ast.Module(body=[body], type_ignores=[]))
    exec(compile(module, str(path), "exec"), namespace)
    return namespace["LiftedMegatronWorker"]


def _torch_on_cpu():
    """``torch`` for the wrapper module, whose ``torch.cuda.current_device()`` names the CPU."""
    import types

    cuda = types.SimpleNamespace(current_device=lambda: "cpu")
    cuda_proxy = type("CudaOnCpu", (), {"__getattr__": lambda self, n: getattr(torch.cuda, n)})
    proxy_cuda = cuda_proxy()
    proxy_cuda.current_device = cuda.current_device

    class TorchOnCpu(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

    module = TorchOnCpu("torch")
    module.cuda = proxy_cuda
    return module


class _Strategy:
    """SkyRL's strategy ``all_reduce`` of a metrics dict over a group (what the worker calls)."""

    def all_reduce(self, metrics, op="mean", group=None):
        import torch.distributed as dist

        # SkyRL's strategy runs one all-reduce per key: ranks with different keys would pair
        # different metrics or hang. Fail at once, naming them, instead.
        keys = [None] * dist.get_world_size(group)
        dist.all_gather_object(keys, sorted(metrics), group=group)
        assert all(k == keys[0] for k in keys), f"metric keys differ over DP ranks: {keys}"
        out = {}
        for key in sorted(metrics):
            value = torch.tensor(float(metrics[key]), dtype=torch.float64)
            if op == "mean":
                dist.all_reduce(value, group=group)
                value /= dist.get_world_size(group)
            else:
                dist.all_reduce(value, op=getattr(dist.ReduceOp, op.upper()), group=group)
            out[key] = float(value)
        return out


def _causal_chunk(ddp_chunk, without_post_process=False):
    """SkyRL's model call ``model(ids, position_ids, te_padding_mask, packed_seq_params=None)``
    on the tiny GPT: real tokens come first after ``remove_left_padding``, so a causal mask gives
    them the attention they get in SkyRL; padded positions are discarded by SkyRL afterwards.

    ``without_post_process``: the chunk has no ``post_process`` anywhere Megatron's
    ``get_attr_wrapped_model`` looks (not on it, no ``.module`` to unwrap), as a model class that
    keeps no such flag (Megatron Bridge's VLM wrappers, a user's own model) would."""
    from megatron_dynbatch.mcore.forward import build_attention_mask

    inner = "_inner" if without_post_process else "module"
    hidden = ("post_process", "module") if without_post_process else ()

    class Causal(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            setattr(self, inner, module)

        def __getattr__(self, name):
            if name in hidden:
                raise AttributeError(name)
            try:
                return super().__getattr__(name)
            except AttributeError:
                if not without_post_process:
                    return getattr(self._modules[inner], name)
            # Everything else Megatron looks up through .module (model_type, config, ...).
            from megatron.core.utils import get_attr_wrapped_model

            try:
                return get_attr_wrapped_model(self._modules[inner], name)
            except RuntimeError:
                raise AttributeError(name) from None

        def set_input_tensor(self, tensor):
            # What Megatron's pipeline schedule looks up (through .module, hidden above).
            from megatron.core.utils import get_attr_wrapped_model

            get_attr_wrapped_model(self._modules[inner], "set_input_tensor")(tensor)

        def forward(self, input_ids, position_ids, attention_mask, packed_seq_params=None, **kw):
            # padding_mask: Megatron's router mask of a MoE model (patch 0004), passed on.
            assert packed_seq_params is None and set(kw) <= {"padding_mask"}, (
                packed_seq_params,
                kw,
            )
            batch, length = position_ids.shape
            mask = build_attention_mask(torch.zeros(batch, length, dtype=torch.int64))
            return self._modules[inner](input_ids, position_ids, mask, **kw)

    return Causal(ddp_chunk)


def _samples(num, stepwise, seed=SEED):
    """(prompt tokens, response tokens, loss mask, uid) per sample; step-wise: trajectories of 1-3
    turns whose every turn's prompt is the trajectory so far (SkyRL's step-wise training). The uid
    names the trajectory's prompt (one trajectory per prompt), contiguous as SkyRL's are."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < num:
        uid = f"p{len({s[3] for s in out})}"
        prompt = torch.randint(
            1, VOCAB, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen
        )
        turns = int(torch.randint(1, 4, (1,), generator=gen)) if stepwise else 1
        for _ in range(turns):
            if len(out) == num:
                break
            response = torch.randint(
                1, VOCAB, (int(torch.randint(2, 13, (1,), generator=gen)),), generator=gen
            )
            mask = (torch.rand(response.numel(), generator=gen) > 0.2).to(torch.int64)
            out.append((prompt, response, mask, uid))
            prompt = torch.cat([prompt, response, torch.randint(1, VOCAB, (2,), generator=gen)])
    return out


def _minibatch(samples, loss_reduction, seed=SEED):
    """SkyRL's padded mini-batch: prompts left-padded, responses right-padded, advantages
    pre-scaled by SkyRL's own ``apply_loss_reduction_to_advantages_minibatch`` (``prompt_mean``
    over the prompts of SkyRL's own ``compute_prompt_boundaries``, mini-batch relative)."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import (
        apply_loss_reduction_to_advantages_minibatch,
    )
    from skyrl.train.dataset.preprocess import compute_prompt_boundaries

    gen = torch.Generator().manual_seed(seed + 1)
    n = len(samples)
    prompt_len = max(s[0].numel() for s in samples)
    response_len = max(s[1].numel() for s in samples)
    sequences = torch.zeros((n, prompt_len + response_len), dtype=torch.int64)
    attention = torch.zeros_like(sequences)
    loss_mask = torch.zeros((n, response_len), dtype=torch.int64)
    response_mask = torch.zeros_like(loss_mask)
    for i, (p, r, m, _) in enumerate(samples):
        sequences[i, prompt_len - p.numel() : prompt_len] = p
        sequences[i, prompt_len : prompt_len + r.numel()] = r
        attention[i, prompt_len - p.numel() : prompt_len + r.numel()] = 1
        loss_mask[i, : r.numel()] = m
        response_mask[i, : r.numel()] = 1
    advantages = torch.randn((n, response_len), generator=gen) * response_mask
    scaled = apply_loss_reduction_to_advantages_minibatch(
        advantages,
        loss_mask,
        loss_reduction,
        micro_batch_size=1,
        max_seq_len=response_len,
        prompt_boundaries=compute_prompt_boundaries([s[3] for s in samples]),
    )
    return {
        "sequences": sequences,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "response_mask": response_mask,
        "advantages": scaled,
        "base_action_log_probs": torch.zeros((n, response_len)),
        "rollout_logprobs": None,
    }


def _shard(full, dp, dp_rank, pad_to_dp=True):
    """SkyRL's trainer and dispatch: the mini-batch padded to a multiple of dp by SkyRL's own
    ``pad_training_input_batch`` (loss-masked copies), then contiguous equal chunks per DP rank.
    Returns this rank's chunk and the original indices of its real (unpadded) samples.

    ``pad_to_dp=False`` skips the padding, so the last ranks may get no row at all: SkyRL's
    dispatch never does that at the pinned commit, the case guards the plan's empty-rank path."""
    import math

    from skyrl.backends.skyrl_train.training_batch import (
        TrainingInputBatch,
        pad_training_input_batch,
    )

    n = full["sequences"].shape[0]
    batch = TrainingInputBatch(dict(full))
    batch.metadata = {"response_length": full["loss_mask"].shape[1]}
    if not pad_to_dp:
        per = math.ceil(n / dp)
        lo, hi = min(n, dp_rank * per), min(n, (dp_rank + 1) * per)
        return {k: None if v is None else v[lo:hi] for k, v in full.items()}, list(range(lo, hi))
    padded = pad_training_input_batch(batch, math.ceil(n / dp) * dp - n)
    per = padded["sequences"].shape[0] // dp
    lo, hi = dp_rank * per, (dp_rank + 1) * per
    chunk = {k: None if v is None else v[lo:hi] for k, v in padded.items()}
    return chunk, list(range(lo, min(hi, n)))


def _skyrl_body(
    skyrl_root,
    num,
    stepwise,
    loss_reduction,
    budget,
    dynamic=True,
    pad_to_dp=True,
    window=None,
    without_post_process=False,
    moe=False,
):
    """SkyRL's worker methods on this rank's shard of the mini-batch ``_samples(...)[window]``
    (``window``: one mini-batch ``(start, end)`` of the step; default all samples;
    ``without_post_process``: model chunks without that flag, see :func:`_causal_chunk`; ``moe``:
    the tiny MoE with an aux loss and the z-loss, and the tokens its routers count in training)."""
    import dataclasses

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    stubbed = _install_stubs()
    _import_skyrl(skyrl_root)
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
    from skyrl.backends.skyrl_train.workers.megatron import megatron_model_wrapper
    from skyrl.train.config import TrainerConfig

    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        make_schedule_config_safe,
        named_global_grads,
        tiny_transformer_config,
        wrap_in_ddp,
    )

    assert megatron_model_wrapper.__file__.startswith(skyrl_root)
    # The wrapper moves each micro-batch to torch.cuda.current_device(); on CPU it is already home.
    megatron_model_wrapper._copy_tensor_dict_to_device = lambda batch, device: batch
    megatron_model_wrapper.torch = _torch_on_cpu()
    pp = ps.get_pipeline_model_parallel_world_size()
    dp = ps.get_data_parallel_world_size()
    dp_rank = ps.get_data_parallel_rank()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    config = tiny_transformer_config(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        # SkyRL runs Megatron's default: the schedule divides by the micro-batch count and DDP
        # averages over DP, which its loss undoes (x num_microbatches x dp_size).
        calculate_per_token_loss=False,
        **(MOE if moe else {}),
    )
    if moe:
        config.moe_router_load_balancing_type = "aux_loss"
        config.moe_aux_loss_coeff = 1e-2
        config.moe_z_loss_coeff = 1e-3
    # SkyRL's worker sets variable_seq_lengths (megatron_worker.py: provider.variable_seq_lengths).
    config = dataclasses.replace(
        config, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall"
    )
    make_schedule_config_safe(config)
    ddp_chunks = wrap_in_ddp(build_tiny_gpt(config, seed=SEED))
    chunks = [_causal_chunk(c, without_post_process) for c in ddp_chunks]

    cfg = TrainerConfig()
    cfg.remove_microbatch_padding = False
    cfg.algorithm.use_kl_loss = False
    cfg.algorithm.use_entropy_loss = False
    cfg.algorithm.loss_reduction = loss_reduction
    cfg.algorithm.temperature = 1.0
    cfg.max_tokens_per_microbatch = budget
    cfg.use_dynamic_batch_size = dynamic
    cfg.micro_train_batch_size_per_gpu = 2
    cfg.micro_forward_batch_size_per_gpu = 2
    wrapper = megatron_model_wrapper.MegatronModelWrapper(
        cfg,
        chunks,
        policy_loss_fn=PolicyLossRegistry.get(cfg.algorithm.policy_loss_type),
    )

    worker = _lifted_worker_class(skyrl_root)()
    worker.cfg = cfg
    worker.model = wrapper
    worker.actor_module = chunks
    worker.optimizer = None
    worker.enable_router_replay = False
    worker.empty_cuda_cache = False
    worker.strategy = _Strategy()

    samples = _samples(num, stepwise)[slice(*(window or (0, num)))]
    full = _minibatch(samples, loss_reduction)
    mine, positions = _shard(full, dp, dp_rank, pad_to_dp)
    data = TrainingInputBatch(mine)
    data.metadata = {"response_length": full["loss_mask"].shape[1]}

    log_probs = worker._forward_logprobs(data)
    # Old log-probs for the PPO ratio: the last stage's, on every stage of this pipeline.
    holder = [log_probs if ps.is_pipeline_last_stage(ignore_virtual=True) else None]
    dist.broadcast_object_list(
        holder,
        src=ps.get_pipeline_model_parallel_last_rank(),
        group=ps.get_pipeline_model_parallel_group(),
    )
    old = holder[0].clone()
    data["action_log_probs"] = old
    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    # Imported here: SkyRL's unit-test run loads this module by path, without ``tests``.
    from tests._support import RouterTokens

    with RouterTokens().installed() as router_tokens:
        router_tokens.active = True
        output = worker.forward_backward(data)
    wrapper.run_pending_grad_sync()
    return {
        "stubbed": stubbed,
        "router_tokens": router_tokens.per_layer,
        # Attended tokens of this rank's rows (SkyRL's pad copies are rows of its own).
        "attended_tokens": int(mine["attention_mask"].sum()),
        "finite": all(
            bool(torch.isfinite(g).all()) for g in named_global_grads(ddp_chunks).values()
        ),
        "grads": {k: v.clone() for k, v in named_global_grads(ddp_chunks).items()},
        "log_probs": old,
        "positions": positions,
        "rows": mine["sequences"].shape[0],
        "metrics": dict(output.metrics),
        "loss_fn_outputs": list(output.loss_fn_outputs),
        "response_lengths": mine["response_mask"].sum(-1).tolist(),
    }


def _reference_body(num, stepwise, loss_reduction, skyrl_root, window=None):
    """Each sample alone through a single-process tiny GPT: the summed pre-scaled PPO loss at
    ratio 1 (SkyRL's policy loss is a sum over tokens of pre-scaled advantages)."""
    _install_stubs()
    _import_skyrl(skyrl_root)
    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        named_global_grads,
        response_outputs,
        tiny_transformer_config,
    )

    samples = _samples(num, stepwise)[slice(*(window or (0, num)))]
    full = _minibatch(samples, loss_reduction)
    [model] = build_tiny_gpt(tiny_transformer_config(), seed=SEED)

    def response_log_probs(i):
        p, r, _, _ = samples[i]
        scored = torch.log_softmax(response_outputs(model, p, r).float(), dim=-1)
        return scored.gather(1, r.unsqueeze(1)).squeeze(1)

    model.zero_grad()
    total = 0.0
    log_probs = []
    for i, (_, r, m, _) in enumerate(samples):
        lp = response_log_probs(i)
        log_probs.append(lp.detach())
        adv = full["advantages"][i, : r.numel()]
        total = total + (-adv * torch.exp(lp - lp.detach()) * m).sum()
    total.backward()
    return {"grads": named_global_grads([model]), "log_probs": log_probs, "samples": samples}


def _prompt_minibatches(skyrl_root, uids):
    """SkyRL's own ``compute_prompt_mini_batch_boundaries`` (step-wise, one trajectory per
    prompt), with the most prompts per mini-batch that still gives two mini-batches or more."""
    _install_stubs()
    _import_skyrl(skyrl_root)
    from skyrl.train.dataset.preprocess import compute_prompt_mini_batch_boundaries

    num_prompts = len(set(uids))
    per_minibatch = max(k for k in range(1, num_prompts) if num_prompts % k == 0)
    return compute_prompt_mini_batch_boundaries(uids, per_minibatch, num_prompts, True, 1)


def _check_against_reference(results, reference, num, what):
    """Gradients (relative) and log-probs (absolute) within tolerance, every sample seen once,
    and the training pass's per-sample ``loss_fn_outputs`` in sample order; prints the figures."""
    merged = {}
    for r in results:
        merged.update(r["grads"])  # every rank holds the DP-reduced gradients of its stage
    assert set(merged) == set(reference["grads"])
    worst = 0.0
    for name, ref in reference["grads"].items():
        err = relative_error(merged[name], ref)
        worst = max(worst, err)
        assert err <= REL_TOL, (name, err)
    worst_lp = worst_out = 0.0
    seen = set()  # the ranks of one pipeline report the same samples
    for r in results:
        # One loss_fn_outputs entry per row this rank was given (SkyRL's pad copies included,
        # placeholders not), in the rank's sample order: each row's log-probs are its own.
        assert len(r["loss_fn_outputs"]) == r["rows"], (len(r["loss_fn_outputs"]), r["rows"])
        for row, out in enumerate(r["loss_fn_outputs"]):
            valid = int(r["response_lengths"][row])
            want = r["log_probs"][row, r["log_probs"].shape[1] - valid :]
            worst_out = max(worst_out, float((torch.tensor(out["logprobs"]) - want).abs().max()))
        for row, position in enumerate(r["positions"]):
            seen.add(position)
            want = reference["log_probs"][position]
            got = r["log_probs"][row, : want.numel()]  # rows past the real ones: SkyRL's pads
            worst_lp = max(worst_lp, float((got - want).abs().max()))
    assert seen == set(range(num))
    assert worst_lp <= 1e-5 and worst_out <= 1e-5, (worst_lp, worst_out)
    print(
        f"\n[skyrl {what}] grad rel diff max={worst:.2e} log-prob abs diff max={worst_lp:.2e} "
        f"loss_fn_outputs abs diff max={worst_out:.2e} "
        f"microbatches={results[0]['metrics'].get('num_microbatches')} "
        f"stubbed={results[0]['stubbed']}"
    )


#: The tiny MoE of the router-statistics cases: 4 layers, 4 experts, top-2.
MOE = {"num_layers": 4, "num_moe_experts": 4, "moe_router_topk": 2}


@needs_skyrl
@pytest.mark.parametrize("num, pad_to_dp", [(9, True), (1, False)], ids=["pp2-dp2", "empty-rank"])
def test_moe_routers_count_only_the_attended_tokens_of_real_rows(patched_skyrl, num, pad_to_dp):
    """Patch 0004: a tiny MoE (aux loss and z-loss on) through SkyRL's forward_backward at pp 2,
    dp 2 with planned micro-batches: every router of every rank counts exactly the attended tokens
    of the rank's rows, none of the padding after them and none of a placeholder row; a rank with
    placeholders only (no row at all) counts nothing, and its gradients stay finite."""
    results = run_on_ranks(
        4,
        _skyrl_body,
        patched_skyrl,
        num,
        False,
        "token_mean",
        40,
        pad_to_dp=pad_to_dp,
        moe=True,
        layout=Layout(pp=2),
        timeout_s=BODY_TIMEOUT_S,
    )
    if not pad_to_dp:
        assert any(r["rows"] == 0 for r in results)
    for r in results:
        assert r["finite"]
        layers = r["router_tokens"]
        assert len(layers) == MOE["num_layers"] // 2, layers
        assert all(count == r["attended_tokens"] for count in layers.values()), (
            layers,
            r["attended_tokens"],
        )


def _packed_mask_body(skyrl_root):
    """SkyRL's own ``preprocess_packed_seqs`` (THD, its default ``remove_microbatch_padding``) on
    left-padded rows with non-zero token ids and a placeholder row: the padding mask must be True
    exactly where the packed row holds no real token."""
    _install_stubs()
    _import_skyrl(skyrl_root)
    from megatron.core.packed_seq_params import PackedSeqParams  # noqa: F401 (SkyRL's import)
    from skyrl.backends.skyrl_train.distributed.megatron.megatron_utils import (
        preprocess_packed_seqs,
    )

    from megatron_dynbatch.integrations.skyrl.iterator import placeholder_rows
    from megatron_dynbatch.integrations.skyrl.moe import packed_padding_mask
    from megatron_dynbatch.runtime.placeholders import PLACEHOLDER_INDEX

    lengths, width = [5, 9, 2], 12
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):  # left padding, as SkyRL's rows come
        ids[row, width - n :] = torch.arange(1, n + 1)
        attention[row, width - n :] = 1
    filler = placeholder_rows({"sequences": ids, "attention_mask": attention}, 1)
    ids = torch.cat([ids, filler["sequences"]])
    attention = torch.cat([attention, filler["attention_mask"]]).to(torch.bool)
    sample_index = torch.tensor([0, 1, 2, PLACEHOLDER_INDEX])  # the marker of the placeholder row
    packed, params = preprocess_packed_seqs(ids, attention, pre_process=True)
    mask = packed_padding_mask(attention, sample_index, params, cp_rank=0, cp_size=1)
    return packed, mask


@needs_skyrl
def test_packed_padding_mask_marks_what_preprocess_packed_seqs_leaves_empty(patched_skyrl):
    [(packed, mask)] = run_on_ranks(1, _packed_mask_body, patched_skyrl, layout=Layout())
    assert mask.shape == packed.shape and mask.dtype == torch.bool
    # Real tokens carry ids >= 1; alignment pads and the placeholder row's token are 0.
    assert torch.equal(mask, packed == 0), (mask, packed)
    assert int((~mask).sum()) == 5 + 9 + 2


CASES = [
    # (world, layout, samples, step-wise, loss reduction, budget, SkyRL's padding to dp)
    pytest.param(2, Layout(pp=2), 9, False, "token_mean", 40, True, id="pp2-dp1-token-mean"),
    pytest.param(4, Layout(pp=2), 9, False, "token_mean", 40, True, id="pp2-dp2-token-mean"),
    pytest.param(
        4, Layout(pp=2), 8, True, "sequence_mean", 48, True, id="pp2-dp2-stepwise-seq-mean"
    ),
    pytest.param(
        4, Layout(pp=2), 1, False, "token_mean", 40, True, id="pp2-dp2-fewer-samples-than-dp"
    ),
    # DP rank 1 gets no row at all (not even SkyRL's pad copy): placeholders only.
    pytest.param(4, Layout(pp=2), 1, False, "token_mean", 40, False, id="pp2-dp2-empty-rank"),
    # Needs patch 0003: stock SkyRL unpads every chunk of the last stage as logits.
    pytest.param(2, Layout(pp=2, vpp=2), 9, True, "token_mean", 40, True, id="pp2-vpp2-stepwise"),
]


@needs_skyrl
@pytest.mark.parametrize("world, layout, num, stepwise, reduction, budget, pad_to_dp", CASES)
def test_skyrl_forward_backward_and_logprobs_match_reference(
    patched_skyrl, world, layout, num, stepwise, reduction, budget, pad_to_dp
):
    results = run_on_ranks(
        world,
        _skyrl_body,
        patched_skyrl,
        num,
        stepwise,
        reduction,
        budget,
        pad_to_dp=pad_to_dp,
        layout=layout,
        timeout_s=BODY_TIMEOUT_S,
    )
    [reference] = run_on_ranks(
        1, _reference_body, num, stepwise, reduction, patched_skyrl, layout=Layout()
    )
    if num < world // layout.pp:
        # A DP rank without a real sample: SkyRL's loss-masked pad copy only, or no row at all.
        assert any(not r["positions"] for r in results)
        assert any(r["rows"] == 0 for r in results) == (not pad_to_dp)
    dp = world // layout.pp
    _check_against_reference(
        results,
        reference,
        num,
        f"{layout} dp={dp} {reduction} stepwise={stepwise} padded_to_dp={pad_to_dp}",
    )


@needs_skyrl
def test_prompt_aligned_stepwise_minibatches_match_reference(patched_skyrl):
    """SkyRL #1483: step-wise mini-batches are cut at prompt boundaries (SkyRL's own
    ``compute_prompt_mini_batch_boundaries``), so every turn of a prompt trains in the same
    mini-batch; each mini-batch (uneven sizes, padded to dp by SkyRL) is planned on its own and
    its gradients equal its samples run alone, with SkyRL's ``prompt_mean`` reduction."""
    num = 11
    uids = [s[3] for s in _samples(num, True)]
    # SkyRL is imported on a rank, never in this process (whose path the ranks inherit).
    [windows] = run_on_ranks(1, _prompt_minibatches, patched_skyrl, uids)
    assert len(windows) >= 2
    sizes = [hi - lo for lo, hi in windows]
    assert len(set(sizes)) > 1 or any(size % 2 for size in sizes), "want uneven mini-batches"
    owner = {}
    for m, (lo, hi) in enumerate(windows):
        for uid in uids[lo:hi]:
            assert owner.setdefault(uid, m) == m, f"prompt {uid} split over mini-batches"
    for lo, hi in windows:
        args = (num, True, "prompt_mean")
        results = run_on_ranks(
            4,
            _skyrl_body,
            patched_skyrl,
            *args,
            40,
            window=(lo, hi),
            layout=Layout(pp=2),
            timeout_s=BODY_TIMEOUT_S,
        )
        [reference] = run_on_ranks(
            1, _reference_body, *args, patched_skyrl, window=(lo, hi), layout=Layout()
        )
        _check_against_reference(
            results, reference, hi - lo, f"pp2 dp=2 prompt_mean prompt-aligned [{lo}:{hi})"
        )


@needs_skyrl
def test_patch_0003_lets_skyrl_run_virtual_pipeline_stages_with_the_flag_off(
    stock_skyrl, patched_skyrl
):
    """Patch 0003 fixes SkyRL itself: stock SkyRL's fixed-size micro-batches under pp 2 x vpp 2
    fail in ``recover_left_padding`` (every chunk of the last stage unpadded as logits); the
    patched tree, flag off, runs them and matches the reference."""
    args = (8, True, "token_mean", 0)  # budget 0: SkyRL's stock fixed micro-batches of 2
    kwargs = dict(dynamic=False, layout=Layout(pp=2, vpp=2), timeout_s=BODY_TIMEOUT_S)
    with pytest.raises(DistributedTestError, match="IndexError") as caught:
        run_on_ranks(2, _skyrl_body, stock_skyrl, *args, **kwargs)
    assert "IndexError" in {name for name, _ in caught.value.errors.values()}, caught.value
    results = run_on_ranks(2, _skyrl_body, patched_skyrl, *args, **kwargs)
    [reference] = run_on_ranks(
        1, _reference_body, 8, True, "token_mean", patched_skyrl, layout=Layout()
    )
    _check_against_reference(results, reference, 8, "pp2 x vpp2 flag off (patch 0003)")


@needs_skyrl
def test_with_the_flag_off_patched_skyrl_is_bitwise_stock(stock_skyrl, patched_skyrl):
    """Every patched line runs only with trainer.use_dynamic_batch_size: with it off (SkyRL's own
    TokenBasedBatchIterator at the same budget) the patched tree and the stock checkout give
    bitwise the same log-probs and gradients."""
    runs = {
        name: run_on_ranks(
            4,
            _skyrl_body,
            root,
            9,
            False,
            "token_mean",
            40,
            dynamic=False,
            layout=Layout(pp=2),
            timeout_s=BODY_TIMEOUT_S,
        )
        for name, root in (("patched", patched_skyrl), ("stock", stock_skyrl))
    }
    for mine, theirs in zip(runs["patched"], runs["stock"], strict=True):
        assert mine["grads"].keys() == theirs["grads"].keys()
        for name, grad in mine["grads"].items():
            assert torch.equal(grad, theirs["grads"][name]), name
        assert torch.equal(mine["log_probs"], theirs["log_probs"])
        assert mine["loss_fn_outputs"] == theirs["loss_fn_outputs"]
        assert mine["metrics"] == theirs["metrics"]


@needs_skyrl
def test_patch_0003_leaves_a_model_without_post_process_as_stock(stock_skyrl, patched_skyrl):
    """Patch 0003 runs for every Megatron user of SkyRL, flag on or off. Without virtual pipeline
    stages it must not ask the model anything: a model chunk that keeps no ``post_process`` (no
    pipeline, dp 2, the flag off; with pp > 1 Megatron's own gradient finalisation needs the
    flag) trains bitwise as on the stock checkout."""
    runs = {
        name: run_on_ranks(
            2,
            _skyrl_body,
            root,
            9,
            False,
            "token_mean",
            0,
            dynamic=False,
            without_post_process=True,
            layout=Layout(),
            timeout_s=BODY_TIMEOUT_S,
        )
        for name, root in (("patched", patched_skyrl), ("stock", stock_skyrl))
    }
    for mine, theirs in zip(runs["patched"], runs["stock"], strict=True):
        for name, grad in mine["grads"].items():
            assert torch.equal(grad, theirs["grads"][name]), name
        assert torch.equal(mine["log_probs"], theirs["log_probs"])
        assert mine["loss_fn_outputs"] == theirs["loss_fn_outputs"]


#: What a user put on SkyRL's command line, and the line SkyRL's validate_cfg now answers with.
CONFIG_CASES = (
    (["trainer.strategy=megatron", "trainer.max_tokens_per_microbatch=8192"], None),
    (
        [
            "trainer.strategy=megatron",
            "trainer.max_tokens_per_microbatch=8192",
            "trainer.use_dynamic_batch_size=true",
        ],
        None,
    ),
    (
        ["trainer.strategy=fsdp", "trainer.use_dynamic_batch_size=true"],
        "trainer.strategy='fsdp' would ignore it: set trainer.strategy=megatron",
    ),
    (
        ["trainer.strategy=megatron", "trainer.use_dynamic_batch_size=true"],
        "max_tokens_per_microbatch=-1 must be > 0 with trainer.use_dynamic_batch_size=true",
    ),
    (
        [
            "trainer.strategy=megatron",
            "trainer.max_tokens_per_microbatch=8192",
            "trainer.use_dynamic_batch_size=yes_please",
        ],
        "trainer.use_dynamic_batch_size='yes_please' is not a boolean",
    ),
)


def _validate_cfg(tree, cases):
    """SkyRL's own ``SkyRLTrainConfig.from_cli_overrides`` and ``validate_cfg`` on each case's
    overrides, in a fresh interpreter importing ``tree``: per case the error line or None."""
    import json

    code = (
        "import importlib.util, json, sys; "
        f"spec = importlib.util.spec_from_file_location('_skyrl_stubs', {__file__!r}); "
        "helpers = importlib.util.module_from_spec(spec); spec.loader.exec_module(helpers); "
        f"helpers._install_stubs(); helpers._import_skyrl({str(tree)!r}); "
        "from skyrl.train.config import SkyRLTrainConfig; "
        "from skyrl.train.utils.utils import validate_cfg; "
        "out = []\n"
        f"for overrides in {[list(c) for c in cases]!r}:\n"
        "    try:\n"
        "        cfg = SkyRLTrainConfig.from_cli_overrides(['trainer.logger=console', *overrides])\n"
        "        validate_cfg(cfg); out.append(None)\n"
        "    except Exception as error:\n"
        "        out.append(f'{type(error).__name__}: {error}')\n"
        "print('RESULT ' + json.dumps(out))"
    )
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=path),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    [line] = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[7:])


MEGATRON_ON = [
    "trainer.strategy=megatron",
    "trainer.max_tokens_per_microbatch=8192",
    "trainer.use_dynamic_batch_size=true",
]
#: Bad budgets, each refused naming the key (as typed after the flag).
BAD_BUDGET_CASES = tuple(
    (
        MEGATRON_ON + [f"trainer.max_tokens_per_microbatch={v}"],
        f"trainer.max_tokens_per_microbatch={shown}",
    )
    for v, shown in (("0", "0 must be > 0"), ("-5", "-5 must be > 0"), ("null", "null"))
    + (("100.5", "100.5 must be a whole number"), ("8k", "'8k' must be a whole number"))
)
BAD_MEMORY_CASES = tuple(
    (MEGATRON_ON + [f"trainer.max_memory_gib={v}"], "trainer.max_memory_gib=")
    for v in ("-1", "0", "nan", "inf", "lots")
) + (
    (
        MEGATRON_ON + ["trainer.dynamic_batch_planner=nope"],
        "trainer.dynamic_batch_planner='nope': no planner named 'nope'",
    ),
    (MEGATRON_ON + ["trainer.dynamic_batch_planner=fixed"], "plans padded rows only"),
    (MEGATRON_ON + ["trainer.dynamic_batch_planner=dynbatch"], None),
)
#: One micro-batch's fixed cost: refused unless a finite number >= 0 (SkyRL's CLI reads ``nan``
#: as a string), accepted as told.
OVERHEAD = "trainer.dynamic_batch_cost_microbatch_overhead"
OVERHEAD_CASES = tuple(
    (MEGATRON_ON + [f"{OVERHEAD}={v}"], f"{OVERHEAD}={shown} must be a finite number >= 0")
    for v, shown in (("-1", "-1"), ("nan", "'nan'"), ("lots", "'lots'"), ("true", "True"))
) + ((MEGATRON_ON + [f"{OVERHEAD}=330"], None), (MEGATRON_ON + [f"{OVERHEAD}=0"], None))
#: Our keys with the flag off (stock SkyRL refuses them as unknown keys): refused, not ignored.
OFF_CASES = tuple(
    (
        ["trainer.strategy=megatron", "trainer.max_tokens_per_microbatch=8192", f"{key}={v}"]
        + flag,
        f"{key}={shown} is read only by megatron_dynbatch's dynamic batching, which is off",
    )
    for key, v, shown in (
        ("trainer.max_memory_gib", "40", "40"),
        ("trainer.dynamic_batch_planner", "dynbatch", "'dynbatch'"),
        (OVERHEAD, "330", "330"),
    )
    for flag in ([], ["trainer.use_dynamic_batch_size=false"])
)


@needs_skyrl
def test_validate_cfg_refuses_use_dynamic_batch_size_where_it_does_nothing(patched_skyrl):
    """SkyRL's own ``SkyRLTrainConfig.from_cli_overrides`` and ``validate_cfg`` (patch 0001) on
    the overrides a user typed: the flag with strategy=fsdp, without max_tokens_per_microbatch,
    spelled yes_please, with a budget that is no whole number > 0, a memory budget that is no
    number of GiB or a per-micro-batch overhead that is no finite number >= 0, and our keys with
    the flag off, are refused in one line naming SkyRL's key; the flag off or set right passes."""
    replay = [
        "trainer.policy.megatron_config.moe_enable_routing_replay=true",
        "generator.inference_engine.enable_return_routed_experts=true",
        "generator.inference_engine.distributed_executor_backend=mp",
    ]
    # A probe: accepted, and the placeholder rows (no recorded experts) counted in the router.
    replay_case = ((MEGATRON_ON + replay, "moe_enable_routing_replay=true with"),)
    # A probe: an interleaving group under the pipeline passed, refused at the first step.
    kwargs = "trainer.policy.megatron_config.transformer_config_kwargs"
    interleaved = MEGATRON_ON + [
        "trainer.placement.policy_num_gpus_per_node=2",
        "trainer.placement.colocate_all=false",
        "trainer.placement.ref_num_gpus_per_node=2",
        "trainer.policy.megatron_config.pipeline_model_parallel_size=2",
        f"{kwargs}.virtual_pipeline_model_parallel_size=2",
    ]
    replay_case += (
        (interleaved + [f"{kwargs}.microbatch_group_size_per_vp_stage=1"], "stage=1 is smaller"),
        (interleaved + [f"{kwargs}.microbatch_group_size_per_vp_stage=2"], None),
    )
    cases = CONFIG_CASES + BAD_BUDGET_CASES + BAD_MEMORY_CASES + OVERHEAD_CASES + OFF_CASES
    cases += replay_case
    results = _validate_cfg(patched_skyrl, [c for c, _ in cases])
    for (overrides, expected), got in zip(cases, results, strict=True):
        if expected is None:
            assert got is None, (overrides, got)
        else:
            assert got is not None and got.startswith("DynBatchValueError: "), (overrides, got)
            assert expected in got and "\n" not in got, (overrides, got)


@needs_skyrl
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_memory_budget_is_planned_in_validate_cfg_naming_trainer_max_memory_gib(
    patched_skyrl, tmp_path, moe
):
    """``trainer.max_memory_gib`` through SkyRL's ``validate_cfg``: too small for a micro-batch
    of ``max_tokens_per_microbatch`` is refused naming the key and the smallest budget that
    works; that budget passes, a little less does not; the token budget it names fits."""
    import json
    import re

    hf = dict(QWEN2_05B_HF, **(SMALL_MOE_HF if moe else {}))
    (tmp_path / "config.json").write_text(json.dumps(hf))
    base = MEGATRON_ON + [
        f"trainer.policy.model.path={tmp_path}",
        "trainer.placement.colocate_all=false",
        "trainer.placement.ref_num_gpus_per_node=2",
        "trainer.placement.policy_num_gpus_per_node=2",
        "trainer.placement.colocate_all=false",
        "trainer.placement.ref_num_gpus_per_node=2",
        "trainer.placement.ref_num_gpus_per_node=2",
        "trainer.policy.megatron_config.pipeline_model_parallel_size=2",
    ]
    [small] = _validate_cfg(patched_skyrl, [base + ["trainer.max_memory_gib=4"]])
    assert small.startswith("DynBatchValueError: trainer.max_memory_gib=4 is too small"), small
    assert "trainer.max_tokens_per_microbatch=8192" in small, small
    need = float(re.search(r"to at least ([0-9]+\.[0-9]+)", small).group(1))
    lower = re.search(r"lower trainer.max_tokens_per_microbatch to at most (\d+)", small)
    cases = [base + [f"trainer.max_memory_gib={need}"]]
    cases.append(base + [f"trainer.max_memory_gib={need - 0.01:.3f}"])
    if lower:
        cases.append(
            base
            + ["trainer.max_memory_gib=4", f"trainer.max_tokens_per_microbatch={lower.group(1)}"]
        )
    results = _validate_cfg(patched_skyrl, cases)
    assert results[0] is None, results[0]
    assert "is too small" in results[1], results[1]
    if lower:
        assert results[2] is None, results[2]
    print(f"\n[SkyRL trainer.max_memory_gib, moe={moe}] smallest {need} GiB; {small}")


@needs_skyrl
def test_with_the_flag_off_patched_validate_cfg_is_stock(stock_skyrl, patched_skyrl):
    """The way back on SkyRL's config path: with the flag absent or false, every case (bad
    budgets, and cases SkyRL itself refuses) gives patched ``validate_cfg`` the stock result."""
    cases = [
        ["trainer.strategy=megatron", "trainer.max_tokens_per_microbatch=8192"],
        ["trainer.strategy=megatron", "trainer.max_tokens_per_microbatch=0"],
        ["trainer.strategy=megatron", "trainer.max_tokens_per_microbatch=-5"],
        ["trainer.strategy=megatron", "trainer.max_tokens_per_microbatch=8k"],
        ["trainer.strategy=megatron", "trainer.max_tokens_per_microbatch=100.5"],
        ["trainer.strategy=fsdp", "trainer.max_training_steps=0"],  # SkyRL raises
        ["trainer.strategy=megatron", "trainer.policy_mini_batch_size=7"],  # SkyRL raises
    ]
    stock = _validate_cfg(stock_skyrl, cases)
    patched = _validate_cfg(patched_skyrl, cases)
    off = _validate_cfg(
        patched_skyrl, [c + ["trainer.use_dynamic_batch_size=false"] for c in cases]
    )
    assert patched == stock, (patched, stock)
    assert off == stock, (off, stock)
    assert any(r is None for r in stock) and any(r is not None for r in stock), stock
