"""Run Megatron-LM's ``pretrain()`` (``megatron.training``) on a CPU-only machine with gloo.

On top of :mod:`megatron_dynbatch.cpu.core_shim` (megatron.core's schedules, model, DDP),
Megatron-LM's training loop asks for CUDA in a few more places. :func:`apply_training_cpu_shim`
handles each one explicitly, only when CUDA is absent (with CUDA it does nothing):

* ``torch`` inside the named ``megatron.training`` / optimizer modules becomes the shim's proxy,
  so their ``device="cuda"`` tensors (loss sums, flags, timers, grad-norm and found-inf buffers)
  live on the CPU and their stream / cache / synchronise calls are no-ops;
* ``initialize_megatron`` is entered with CUDA "present" for its own checks only: its assert
  ("Megatron requires CUDA."), ``torch.cuda.device_count()`` (model-parallel groups are created
  only when it is positive) and ``set_device``;
* tied input / output embeddings are synchronised between the first and last pipeline stages with
  ``weight.data.cuda()`` in ``LanguageModule.setup_embeddings_and_output_layer``: during that call
  only, ``Tensor.cuda`` returns the tensor itself (the weight stays on the CPU);
* gradient clipping (``--clip-grad``) works: Megatron's ``clip_grad_by_total_norm_fp32`` asserts
  that every gradient is a ``torch.cuda.FloatTensor``; the optimizer module gets the same scaling
  by ``min(1, max_norm / (total_norm + 1e-6))`` with an fp32 check that holds on the CPU;
* Megatron's argument checks ask for the GPU architecture with tensor or context parallelism
  (``get_device_arch_version``, to require ``CUDA_DEVICE_MAX_CONNECTIONS=1`` before Blackwell, a
  CUDA stream-scheduling rule): without a GPU no such rule applies, so the architecture reported
  is one without it (10);
* ``set_jit_fusion_options`` is skipped: it warms up CUDA fusion kernels with ``torch.rand`` on the
  GPU (on CPU it would only consume random numbers);
* the dataset index helpers are not recompiled when the prebuilt extension is importable: the
  megatron-core wheel ships ``helpers_cpp`` but no Makefile, so Megatron's ``make`` step fails.
  (That last fix is not CPU-specific: :func:`skip_helper_compilation_if_prebuilt` is applied by the
  launch script on GPUs too.)

Flags: :func:`add_cpu_defaults` makes the CPU-capable values the defaults of Megatron's parser
(gloo, local transformer implementation, CPU initialisation, no CUDA fusions) so a stock command
line runs unchanged, and :func:`check_cpu_args` refuses, with the flag to change, a value given
explicitly that needs CUDA. Nothing happens at import time, and ``sitecustomize`` / site-packages
are never touched.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.resources
import sys
import types
from typing import Any, List

import torch

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim, cpu_torch_proxy
from megatron_dynbatch.errors import DynBatchValueError

__all__ = [
    "CPU_DEFAULTS",
    "add_cpu_defaults",
    "apply_training_cpu_shim",
    "check_cpu_args",
    "check_cpu_args_before_validation",
    "provide_typing_override",
    "skip_helper_compilation_if_prebuilt",
]

# Modules of megatron.training (and the optimizer) whose ``torch`` becomes the CPU proxy, and why.
_TRAINING_MODULES = (
    # The training loop: loss and flag tensors on "cuda", empty_cache, the DDP init stream.
    "megatron.training.training",
    # Loss / grad-norm statistics are reduced in cuda tensors.
    "megatron.training.utils.common_utils",
    # Timers synchronise and reduce their times in cuda tensors.
    "megatron.core.timers",
    # The DDP wrap runs on a side stream.
    "megatron.training.models.dist_utils",
    # Checkpoint save / load: the RNG state and the rerun state machine's tensors.
    "megatron.training.checkpointing",
    # The fp32 optimizer wrapper keeps its found-inf flag and grad scaler on the current GPU.
    "megatron.core.optimizer.optimizer",
    # Gradient-norm clipping accumulates the norm in a cuda tensor.
    "megatron.core.optimizer.clip_grads",
    # The rerun state machine's NaN / spiky-loss checks reduce flags in cuda tensors.
    "megatron.core.rerun_state_machine",
    # Distributed checkpoints (--ckpt-format torch_dist, Megatron's default): the writers
    # synchronise the GPU before copying tensors, the exchange of shards stages them on "cuda".
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.torch",
)

# Values of Megatron-LM's arguments that a CPU/gloo run needs, made the parser's defaults when CUDA
# is absent (argparse destination -> (value, the flag a user would otherwise pass, why)).
CPU_DEFAULTS = {
    "distributed_backend": ("gloo", "--distributed-backend gloo", "NCCL needs GPUs"),
    "transformer_impl": (
        "local",
        "--transformer-impl local",
        "transformer-engine does not install without CUDA",
    ),
    "use_cpu_initialization": (
        True,
        "--use-cpu-initialization",
        "parameters are created on the CPU, not moved to a GPU",
    ),
    "gradient_accumulation_fusion": (
        False,
        "--no-gradient-accumulation-fusion",
        "the fused weight-gradient kernel is CUDA-only (APEX / TE)",
    ),
    "no_persist_layer_norm": (
        True,
        "--no-persist-layer-norm",
        "the persistent layer-norm kernel is CUDA-only (APEX)",
    ),
    "masked_softmax_fusion": (
        False,
        "--no-masked-softmax-fusion",
        "the fused softmax kernels are CUDA-only",
    ),
    "bias_gelu_fusion": (False, "--no-bias-gelu-fusion", "a torch.compile'd CUDA fusion"),
    "bias_swiglu_fusion": (False, "--no-bias-swiglu-fusion", "a torch.compile'd CUDA fusion"),
    "bias_dropout_fusion": (False, "--no-bias-dropout-fusion", "a torch.compile'd CUDA fusion"),
    "apply_rope_fusion": (False, "--no-rope-fusion", "the fused RoPE kernel is CUDA-only"),
}


def _cuda_absent() -> bool:
    return not torch.cuda.is_available()


def add_cpu_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Without CUDA, make the :data:`CPU_DEFAULTS` the defaults of Megatron's parser.

    Chain it into the ``extra_args_provider``; flags given on the command line still win (and are
    then checked by :func:`check_cpu_args`). With CUDA the parser is returned unchanged.
    """
    if _cuda_absent():
        parser.set_defaults(**{dest: value for dest, (value, _, _) in CPU_DEFAULTS.items()})
    return parser


def check_cpu_args_before_validation(args: Any) -> None:
    """Without CUDA, the flags that need it, refused before Megatron's own ``validate_args``
    runs and prints its ~780-line argument dump (on the parsed flags; :func:`check_cpu_args`
    checks again after it, where Megatron may have set more).

    ``--moe-grouped-gemm``: ``validate_args`` reads ``torch.cuda.get_device_capability()``, which
    stopped the run with "Torch not compiled with CUDA enabled" (a probe of Megatron-LM's Mixtral
    script), before the refusal could name the flag.
    """
    _refuse(_cpu_problems(args, validated=False))


def check_cpu_args(args: Any) -> None:
    """Without CUDA, refuse arguments that need it, naming every flag to change at once (a
    probe: three such flags were refused one at a time).

    Raises:
        ValueError: e.g. ``--transformer-impl transformer_engine`` or ``--fp16`` on a CPU machine.
    """
    _refuse(_cpu_problems(args, validated=True))


def _refuse(problems: List[str]) -> None:
    if len(problems) == 1:
        raise DynBatchValueError(problems[0])
    if problems:
        raise DynBatchValueError(
            f"{len(problems)} settings need CUDA, which this machine lacks: "
            + " ".join(f"({k}) {text}" for k, text in enumerate(problems, start=1))
        )


def _cpu_problems(args: Any, *, validated: bool) -> List[str]:
    """Each flag of ``args`` a CPU run cannot take, with its fix. Before Megatron's
    ``validate_args`` (``validated`` False) sequence parallelism counts only with tensor
    parallelism: Megatron turns it off at tp 1 itself."""
    if not _cuda_absent():
        return []
    problems = []
    for dest, (value, flag, why) in CPU_DEFAULTS.items():
        if hasattr(args, dest) and getattr(args, dest) != value:
            problems.append(
                f"this machine has no CUDA, and {dest}={getattr(args, dest)!r} needs it ({why}); "
                f"pass {flag} or leave the flag out (it is the default without CUDA)."
            )
    for dest, flag in (("fp16", "--fp16"), ("bf16", "--bf16")):
        if getattr(args, dest, False):
            problems.append(
                f"{flag} is not supported on CPU (Megatron's mixed-precision optimizer and loss "
                f"scaler are CUDA-only); remove {flag} to train in fp32."
            )
    if getattr(args, "use_distributed_optimizer", False):
        problems.append(
            "--use-distributed-optimizer is not supported on CPU (megatron-core's "
            "DistributedOptimizer accepts only torch.cuda tensors); remove it, and "
            "--overlap-param-gather with it, for the CPU run. On GPUs keep it: dynamic batching "
            "does not change the optimizer."
        )
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if getattr(args, "sequence_parallel", False) and (validated or tp > 1):
        problems.append(
            "--sequence-parallel is not supported on CPU (it needs transformer-engine's or apex's "
            "layer norm; Megatron's torch LayerNorm, the one without CUDA, refuses it); remove it "
            "for the CPU run, tensor parallelism itself runs."
        )
    if getattr(args, "num_experts", None) and tp > 1:
        # Megatron's MoE layer refuses tensor parallelism without sequence parallelism in
        # training, at the first forward (a probe), and sequence parallelism cannot run here.
        problems.append(
            f"--num-experts {args.num_experts} with --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size} is not supported on CPU (Megatron's MoE layer "
            "trains with tensor parallelism only under --sequence-parallel, which needs a GPU); "
            "use --tensor-model-parallel-size 1 for the CPU run (expert parallelism runs)."
        )
    # These stopped a CPU run (switch on or off) at the first step with torch's "Torch not
    # compiled with CUDA enabled", which names no flag.
    if getattr(args, "moe_grouped_gemm", False):
        problems.append(
            "--moe-grouped-gemm is not supported on CPU (Megatron's grouped GEMM experts run "
            "CUDA kernels); remove it for the CPU run, the experts then run one by one. On GPUs "
            "keep it: dynamic batching does not change the experts."
        )
    if getattr(args, "mtp_num_layers", None):
        problems.append(
            f"--mtp-num-layers {args.mtp_num_layers} is not supported on CPU (Megatron's "
            "multi-token prediction logs its loss into CUDA tensors); remove it for the CPU run."
        )
    # A probe: these stopped a CPU run (switch on or off) after the model was built, with
    # "Torch not compiled with CUDA enabled" or a KeyError of torch.cuda's memory statistics.
    cuda_only = (
        (
            "check_weight_hash_across_dp_replicas_interval",
            "--check-weight-hash-across-dp-replicas-interval",
            "hashes the weights on the GPU",
        ),
        ("log_memory_to_tensorboard", "--log-memory-to-tensorboard", "reads torch.cuda's memory"),
        ("iterations_to_skip", "--iterations-to-skip", "skips an iteration with CUDA tensors"),
    )
    for dest, flag, why in cuda_only:
        value = getattr(args, dest, None)
        if value not in (None, False, [], ()):
            problems.append(
                f"{flag} is not supported on CPU (Megatron {why}); remove it for the CPU run."
            )
    return problems


def skip_helper_compilation_if_prebuilt() -> None:
    """Skip Megatron's ``make`` of the dataset index helpers when the built extension imports.

    The megatron-core wheel ships ``megatron/core/datasets/helpers_cpp*.so`` but not the Makefile
    that ``initialize_megatron`` runs on rank 0, which then exits. A Megatron-LM checkout has the
    Makefile, and the compilation runs as usual there.
    """
    datasets_utils = importlib.import_module("megatron.core.datasets.utils")
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return
    makefile = importlib.resources.files("megatron.core.datasets").joinpath("Makefile")
    if makefile.is_file():
        return

    def compile_helpers() -> None:
        """Prebuilt ``helpers_cpp`` found and no Makefile shipped: nothing to compile."""

    datasets_utils.compile_helpers = compile_helpers


# Megatron's clip_grad_by_total_norm_fp32 adds this to the norm before dividing.
_CLIP_EPSILON = 1.0e-6


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU version of ``megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32``.

    Same contract: scale the fp32 gradients (``.grad``, or ``.decoupled_grad``) in place by
    ``max_norm / (total_norm + 1e-6)`` when that is below 1.
    """
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = param.decoupled_grad if use_decoupled_grad else param.grad
        if grad is None:
            continue
        allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
        assert grad.dtype in allowed, f"gradient clipping expects fp32 grads, got {grad.dtype}"
        grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + _CLIP_EPSILON)
    if isinstance(clip_coeff, torch.Tensor):
        clip_coeff = clip_coeff.clamp_max(1.0)
        torch._foreach_mul_(grads, clip_coeff)
    elif clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    """``Tensor.cuda`` returns the tensor itself inside the block (CPU runs, single thread)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _keep_tied_embeddings_on_cpu() -> None:
    language_module = importlib.import_module(
        "megatron.core.models.common.language_module.language_module"
    )
    cls = language_module.LanguageModule
    setup = cls.setup_embeddings_and_output_layer
    if getattr(setup, "_cpu_shim", False):
        return

    @functools.wraps(setup)
    def setup_on_cpu(self, *args, **kwargs):
        with _tensor_cuda_is_identity():
            return setup(self, *args, **kwargs)

    setup_on_cpu._cpu_shim = True
    cls.setup_embeddings_and_output_layer = setup_on_cpu


def provide_typing_override() -> None:
    """Let ``megatron.training`` import on Python 3.11; a no-op on 3.12 and newer.

    ``megatron.training`` (0.19) imports ``typing.override``, new in Python 3.12; the identical
    ``typing_extensions.override`` (installed with torch) stands in for it.
    """
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def apply_training_cpu_shim() -> None:
    """Make ``megatron.training``'s ``pretrain()`` and ``train_step`` run on CPU; idempotent.

    Call it before ``pretrain()`` (after :func:`megatron_dynbatch.integrations.megatron_lm.patched_tree.
    use_patched_training`, which must precede any ``megatron.training`` import). A no-op with CUDA.
    On Python 3.11 it also provides ``typing.override`` (:func:`provide_typing_override`), with
    or without CUDA.
    """
    provide_typing_override()
    if not _cuda_absent():
        return
    apply_cpu_shim()
    cpu_stream = types.SimpleNamespace(
        wait_stream=lambda *a, **k: None,
        wait_event=lambda *a, **k: None,
        synchronize=lambda *a, **k: None,
    )
    proxy = cpu_torch_proxy(
        empty_cache=lambda: None,
        Stream=lambda *a, **k: cpu_stream,
        stream=lambda s=None: contextlib.nullcontext(),
        current_stream=lambda device=None: cpu_stream,
    )
    for name in _TRAINING_MODULES:
        importlib.import_module(name).torch = proxy
    # initialize_megatron checks for CUDA itself (assert, device_count, set_device): inside that
    # module only, CUDA is "present" with one device that is the CPU.
    initialize = importlib.import_module("megatron.training.initialize")
    initialize.torch = cpu_torch_proxy(
        is_available=lambda: True, device_count=lambda: 1, set_device=lambda device: None
    )
    # Imported by name into the argument checks; no GPU, no CUDA stream-scheduling requirement.
    importlib.import_module("megatron.training.arguments").get_device_arch_version = lambda: 10
    training = sys.modules["megatron.training.training"]
    training.set_jit_fusion_options = lambda *a, **k: None
    _keep_tied_embeddings_on_cpu()
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    skip_helper_compilation_if_prebuilt()
