"""The CPU shim of megatron.core (``cpu/core_shim.py``), in a fresh interpreter: what it does
happens once, at megatron.core's first import."""

import subprocess
import sys
import textwrap

import pytest
import torch

from tests._support import REPO

pytestmark = pytest.mark.unit


def _run(script: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim does nothing where CUDA exists")
def test_megatron_imports_without_torch_dynamo_and_its_fusions_still_compile_when_called():
    """Decorating Megatron's fusions with ``torch.compile`` imported torch._dynamo and the
    inductor in every process that imports megatron.core (about 2 CPU-seconds a torchrun launch
    of two ranks here); the shim defers that to a fused function's first call."""
    out = _run("""
        import sys

        import torch

        real_compile = torch.compile
        from megatron_dynbatch.cpu.core_shim import apply_cpu_shim, compile_on_first_call

        apply_cpu_shim()
        import megatron.core
        import megatron.core.jit
        from megatron.core.models.gpt import GPTModel
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.fusions.fused_bias_gelu import bias_gelu

        assert "torch._dynamo" not in sys.modules, "megatron.core's import compiled"
        assert torch.compile is real_compile, "torch.compile given back"
        assert megatron.core.jit.jit_fuser is not real_compile

        # A deferred function compiles with the options it was decorated with, when called.
        def double(x):
            return x * 2

        def add_one(x):
            return x + 1

        with compile_on_first_call():
            doubled = torch.compile(double, backend="eager")
            plus_one = torch.compile(backend="eager")(add_one)
        assert "torch._dynamo" not in sys.modules
        assert doubled.__name__ == "double"
        x = torch.arange(4.0)
        assert torch.equal(doubled(x), x * 2) and torch.equal(plus_one(x), x + 1)
        from torch._dynamo.utils import counters

        assert counters["frames"]["ok"] >= 2, dict(counters["frames"])
        # A module is compiled at once, as torch.compile does.
        with compile_on_first_call():
            module = torch.compile(torch.nn.Linear(2, 2), backend="eager")
        assert isinstance(module, torch._dynamo.eval_frame.OptimizedModule), type(module)
        print("ok")
        """)
    assert out.strip().endswith("ok"), out
