"""The stand-ins for trainers' unavailable imports (``tools/testing/host_stubs.py``), in a fresh
interpreter: installing them changes ``sys.modules`` and ``sys.meta_path`` for good."""

import subprocess
import sys
import textwrap

import pytest

from tests._support import REPO

pytestmark = pytest.mark.unit


def test_unstub_gives_back_the_installed_package_a_replace_took():
    """A pool worker ran SkyRL's cases (pydantic replaced by a stand-in) and then NeMo-RL's, whose
    pydantic models failed on the stand-in (``__init_subclass__() takes no keyword arguments``)
    until NeMo-RL's importer called ``unstub``; and a replace after the real pydantic was used
    left real modules behind (checking each with ``getattr`` ran pydantic's lazy imports)."""
    script = textwrap.dedent("""
        from megatron_dynbatch.tools.testing.host_stubs import install_stubs, unstub

        import pydantic
        assert not getattr(pydantic, "__stub__", False)
        install_stubs(("pydantic",), replace=("pydantic",))
        import pydantic
        assert getattr(pydantic, "__stub__", False), "replace answers with a stand-in"
        try:
            class Broken(pydantic.BaseModel, extra="allow"):
                pass
        except TypeError:
            pass
        else:
            raise AssertionError("the stand-in took a model with class keywords")
        unstub(("pydantic",))
        import pydantic
        assert not getattr(pydantic, "__stub__", False), "unstub: the installed package again"

        class Config(pydantic.BaseModel, extra="allow"):
            pass

        assert Config(x=1).x == 1
        # SkyRL's cases again: every real pydantic module forgotten, none imported back by
        # pydantic's own lazy __getattr__ while they are.
        install_stubs(("pydantic",), replace=("pydantic",))
        import sys
        real = [n for n, m in sys.modules.items() if n.split(".")[0] == "pydantic"
                and not getattr(type(m), "__stub__", False)]
        assert not real, real
        import pydantic
        assert getattr(pydantic, "__stub__", False)
        print("ok")
        """)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
