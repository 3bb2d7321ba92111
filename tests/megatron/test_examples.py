"""examples/: the minimal host trains at pp 2 under torchrun, through the documented API only."""

import ast
import math
import re

import pytest

from tests._support import REPO, torchrun

pytestmark = pytest.mark.torchrun

EXAMPLE = REPO / "examples" / "minimal_host.py"


def test_the_minimal_host_trains_three_steps_at_pp_2(tmp_path):
    rc, log, _ = torchrun(2, EXAMPLE, [], log_path=tmp_path / "example.log")
    assert rc == 0, log[-6000:]
    steps = re.findall(r"^step (\d+): (\d+) micro-batches, loss (\S+)$", log, flags=re.M)
    assert [int(s) for s, _, _ in steps] == [0, 1, 2], log[-3000:]
    for _, count, loss in steps:
        # pp 2 needs at least two micro-batches; a 64-token vocabulary starts near ln(64) = 4.16.
        assert int(count) >= 2 and math.isfinite(float(loss)) and float(loss) < 5.0, steps


def test_the_minimal_host_is_short_and_uses_only_the_documented_api():
    source = EXAMPLE.read_text()
    assert len(source.splitlines()) <= 65
    api = (REPO / "docs" / "api.md").read_text()
    used = [
        (node.module, alias.name)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module.startswith("megatron_dynbatch")
        for alias in node.names
    ]
    assert used, "the example imports nothing of ours"
    undocumented = [
        f"{module}.{name}"
        for module, name in used
        if f"`{name}" not in api or module.split(".")[-1] not in api
    ]
    assert not undocumented, f"not in docs/api.md: {undocumented}"
    assert "register_host(" in source and "tools.testing" not in source
