"""The runtime layer depends on torch only: importing it must not pull in Megatron."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def test_runtime_does_not_import_megatron():
    code = (
        "import sys, megatron_dynbatch.runtime\n"
        "bad = sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
