"""Run stock megatron.core (0.19.2) on a CPU-only machine with gloo, for tests and the demo.

Megatron-Core asks for ``cuda`` devices in a handful of places that CPU runs reach (receive
buffers, token counters, the attention scratch buffer, RoPE frequencies, the causal mask, the RNG
tracker, DDP grad buffers). Instead of monkeypatching ``torch`` globally, :func:`apply_cpu_shim`
replaces the ``torch`` name *inside those Megatron modules only* with a thin proxy whose ``cuda``
device requests resolve to the CPU. Everything else in the process (our code, user code, torch
itself) sees the real torch. On a machine with CUDA the shim does nothing, so a patched script
behaves like a stock one.

The shim is opt-in: nothing happens at import time. Call it before the first
``import megatron.core`` (that import needs the triton stand-in registered below when triton is
missing).
"""

import contextlib
import functools
import importlib
import importlib.util
import sys
import types
import warnings

import torch

from megatron_dynbatch.errors import DynBatchRuntimeError

__all__ = [
    "apply_cpu_shim",
    "compile_on_first_call",
    "cpu_torch_proxy",
    "quiet_missing_gpu_library_warnings",
    "register_triton_stand_in",
]

#: megatron.core's import-time notices that the GPU libraries are missing, which every CPU run
#: meets (ten per rank): they buried a start-up error's one line (issue 29) and ``verify``'s
#: verdict (issue 37).
_MISSING_GPU_LIBRARY_WARNINGS = (
    r"(Transformer Engine and Apex are|Apex is) not installed"
    r"|Only transformer-engine>=\S+ supports MoE experts"
)


def quiet_missing_gpu_library_warnings() -> None:
    """Without CUDA, hide megatron.core's notices that transformer-engine and apex are missing.

    They cannot be acted on where there is no GPU; with CUDA they stay (there they matter).
    Call before ``megatron.core`` is first imported (they are issued at import time).
    """
    if not torch.cuda.is_available():
        warnings.filterwarnings(
            "ignore", message=_MISSING_GPU_LIBRARY_WARNINGS, category=UserWarning
        )


# Megatron modules whose module-level ``torch`` gets the CPU proxy, each with the reason.
_PATCHED_MODULES = (
    # Token counter ``torch.zeros([], device="cuda")`` in every schedule.
    "megatron.core.pipeline_parallel.schedules",
    # Receive buffers on ``torch.cuda.current_device()`` and ``torch.cuda.synchronize()``.
    "megatron.core.pipeline_parallel.p2p_communication",
    # ``inv_freq`` is moved to ``torch.cuda.current_device()`` on the first forward.
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    # ``GlobalMemoryBuffer.get_tensor`` (attention scores scratch) allocates on the current GPU.
    "megatron.core.utils",
    # ``get_default_causal_mask`` builds the mask with ``device="cuda"``.
    "megatron.core.transformer.utils",
    # The RNG tracker seeds / saves / restores ``torch.cuda`` generator states; on CPU the
    # tracked states live on the CPU default generator instead.
    "megatron.core.tensor_parallel.random",
    # DDP grad buffers are allocated on ``torch.cuda.current_device()``.
    "megatron.core.distributed.param_and_grad_buffer",
    # MoE all-to-all dispatcher: a class-level ``torch.cuda.Stream()`` for its device-to-host
    # copies of the split sizes, entered with ``torch.cuda.stream``.
    "megatron.core.transformer.moe.token_dispatcher",
    # The MoE router moves its gating weight to ``torch.cuda.current_device()`` on first use.
    "megatron.core.transformer.moe.router",
    # All-gather outputs on ``torch.cuda.current_device()`` (the MoE dispatcher's expert-parallel
    # gather of tokens per expert).
    "megatron.core.tensor_parallel.mappings",
)

# The one module that imports triton unconditionally (it holds Triton kernels for the MoE paged
# stash). It is reached from ``pipeline_parallel.schedules``, so ``import megatron.core`` fails
# without triton even though dense models never launch those kernels.
_TRITON_MODULE = "megatron.core.transformer.moe.ops.paged_stash"

# Tensor factories whose ``device=`` argument the proxy rewrites from cuda to cpu.
_FACTORIES = ("empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor")

_CPU = torch.device("cpu")
_applied = False


def _to_cpu_device(device):
    """Map a cuda device spec (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``) to the CPU."""
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return _CPU
    return device


def _cpu_factory(factory):
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    wrapped.__name__ = factory.__name__
    wrapped.__doc__ = factory.__doc__
    return wrapped


class _CpuCudaNamespace(types.SimpleNamespace):
    """Stand-in for ``torch.cuda`` inside patched modules: devices and RNG map to the CPU.

    Attributes not defined here fall through to the real ``torch.cuda`` (for example
    ``is_available``), so code paths that only run with CUDA still fail loudly if they are reached.
    """

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _noop(*args, **kwargs):
    del args, kwargs


# CPU work runs in program order: waiting on a stream or an event has nothing to wait for.
_CPU_EVENT = types.SimpleNamespace(synchronize=_noop, wait=_noop)
_CPU_STREAM = types.SimpleNamespace(
    wait_event=_noop,
    wait_stream=_noop,
    synchronize=_noop,
    record_event=lambda event=None: _CPU_EVENT,
)

_CPU_CUDA = _CpuCudaNamespace(
    current_device=lambda: _CPU,
    # CPU collectives and kernels are synchronous already.
    synchronize=_noop,
    # DDP's grad sync fences the "current stream" against CUDA-graph events before reducing.
    current_stream=lambda device=None: _CPU_STREAM,
    # Side streams (the MoE dispatcher's) are the one CPU stream; entering one changes nothing.
    Stream=lambda *args, **kwargs: _CPU_STREAM,
    stream=lambda stream=None: contextlib.nullcontext(),
    # The RNG tracker's "cuda" generator is the CPU default generator.
    manual_seed=torch.manual_seed,
    get_rng_state=lambda device=None: torch.get_rng_state(),
    random=types.SimpleNamespace(get_rng_state=lambda device=None: torch.get_rng_state()),
)


class _CpuTorchProxy(types.ModuleType):
    """``torch`` as seen by one patched Megatron module: cuda requests resolve to the CPU."""

    def __init__(self, cuda=_CPU_CUDA):
        super().__init__("torch")
        self.cuda = cuda
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        # Only reached for names not set in __init__: everything else is the real torch.
        return getattr(torch, name)


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    """CPU replacement for ``tensor_parallel.random._set_cuda_rng_state`` (uses torch._C/cuda)."""
    del device, graph_safe
    torch.set_rng_state(new_state)


def _move_to_host(tensor, as_numpy=False, record_stream=False):
    """CPU replacement for the MoE dispatcher's ``maybe_move_tensor_to_cpu``.

    The stock function converts only CUDA tensors (to numpy when asked); a CPU tensor comes back
    as a tensor, which ``all_to_all_single`` refuses as split sizes (expert parallelism > 1).
    """
    del record_stream
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def register_triton_stand_in() -> None:
    """Let ``import megatron.core`` succeed without triton; a no-op when triton is installed.

    Registers a stand-in for the one module that imports triton unconditionally (its kernels raise
    if called). Needed by anything importing megatron.core on such a machine, GPU or not.
    """
    if _TRITON_MODULE in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stand_in = types.ModuleType(_TRITON_MODULE)
    stand_in.__doc__ = "CPU stand-in registered by megatron_dynbatch.cpu.core_shim (no triton)."

    def _kernel_unavailable(*args, **kwargs):
        raise DynBatchRuntimeError(
            "MoE paged-stash Triton kernels are unavailable: triton is not installed and "
            "megatron_dynbatch's CPU shim is active. Disable moe_paged_stash on CPU."
        )

    stand_in.GLOBAL_BLOCK_SIZE = 1024
    stand_in.paged_stash_copy_kernel = _kernel_unavailable
    stand_in.paged_stash_pop_kernel = _kernel_unavailable
    sys.modules[_TRITON_MODULE] = stand_in


@contextlib.contextmanager
def compile_on_first_call():
    """While inside, ``torch.compile`` defers its work to the decorated function's first call.

    Megatron binds ``jit_fuser = torch.compile`` when ``megatron.core.jit`` is imported and
    decorates its fused kernels with it (the MoE router also uses ``@torch.compile``). Decorating
    imports ``torch._dynamo`` and the inductor, about 1.5 s of CPU in every process that imports
    ``megatron.core``, for kernels a CPU run never calls (the fusions are off there). Inside this
    context the decorator returns a function that calls the real ``torch.compile`` with the same
    options on its first call, so whatever is called compiles as it would have (torch compiles
    lazily at the first call too). Anything but a plain function (an ``nn.Module``) goes to the
    real ``torch.compile`` at once. On leaving, ``torch.compile`` is the real one again.
    """
    real_compile = torch.compile

    def deferred(model=None, **options):
        if model is None:
            return functools.partial(deferred, **options)
        if not isinstance(model, types.FunctionType):
            return real_compile(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **options)
            return compiled(*args, **kwargs)

        return call

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = real_compile


def apply_cpu_shim() -> None:
    """Make megatron.core run on CPU with gloo; idempotent; a no-op when CUDA is available.

    Must run before ``megatron.core`` is first imported when triton is missing (the stand-in for
    the triton kernel module has to be in ``sys.modules`` first). Afterwards GPTModel with the
    local layer spec and ``use_cpu_initialization=True``, Megatron DDP with
    ``overlap_grad_reduce=False``, ``finalize_model_grads`` and all three pipeline schedules run on
    CPU tensors. Megatron's fusions imported here are decorated by
    :func:`compile_on_first_call` (compiled when first called, never on CPU runs).
    """
    global _applied
    if _applied or torch.cuda.is_available():
        return
    quiet_missing_gpu_library_warnings()
    register_triton_stand_in()
    proxy = _CpuTorchProxy()
    # The first of these imports megatron.core (its package import decorates the fusions).
    with compile_on_first_call():
        for module_name in _PATCHED_MODULES:
            module = importlib.import_module(module_name)
            assert module.torch is torch or module.torch is proxy, module_name
            module.torch = proxy
    random_module = sys.modules["megatron.core.tensor_parallel.random"]
    random_module._set_cuda_rng_state = _set_cpu_rng_state
    sys.modules["megatron.core.transformer.moe.token_dispatcher"].maybe_move_tensor_to_cpu = (
        _move_to_host
    )
    _applied = True


def cpu_torch_proxy(**cuda_overrides) -> types.ModuleType:
    """A ``torch`` stand-in for one more Megatron module (see ``cpu_training_shim``).

    Args:
        cuda_overrides: ``torch.cuda`` attributes to replace on top of the shim's CPU mapping
            (device, synchronisation and RNG calls), e.g. ``empty_cache=...``.
    """
    cuda = _CpuCudaNamespace(**{**vars(_CPU_CUDA), **cuda_overrides})
    return _CpuTorchProxy(cuda)
