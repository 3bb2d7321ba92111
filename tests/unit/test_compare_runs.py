"""launch/compare_runs.py: the demo's table, with Megatron's own packing run as a third column."""

import pytest

from tests._support import compare_runs

pytestmark = pytest.mark.unit


def _line(i, ms, batch, loss, real=None, computed=None):
    text = (
        f" [t] iteration {i:>8}/ 3 | consumed samples: {i * batch} | elapsed time per iteration "
        f"(ms): {ms} | learning rate: 1.000000E-03 | global batch size: {batch:>5} | "
    )
    if real is not None:
        text += (
            f"micro-batches/rank: 2 [1x512] | real tokens: {real} | computed tokens: {computed} | "
        )
    return text + f"lm loss: {loss:.6E} |\n"


def test_the_stock_run_is_a_third_column(tmp_path, capsys):
    dynamic = "".join(_line(i, 100.0, 8, 5.0 - i, 600, 640) for i in (1, 2, 3))
    fixed = "".join(_line(i, 200.0, 8, 5.0 - i) for i in (1, 2, 3))
    stock = "".join(_line(i, 150.0, 8, 4.0 - i) for i in (1, 2, 3))
    paths = {}
    for name, text in (("dynamic", dynamic), ("fixed", fixed), ("stock", stock)):
        paths[name] = tmp_path / f"{name}.log"
        paths[name].write_text(text)
    argv = ["--dynamic", paths["dynamic"], "--fixed", paths["fixed"], "--seq-length", 128]
    assert compare_runs.main([str(a) for a in argv + ["--stock", paths["stock"]]]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header == ["dynamic", "fixed", "stock"], out
    rows = {line[:26].strip(): line[26:].split() for line in out.splitlines()[1:7]}
    assert rows["time per iteration (ms)"] == ["100.0", "200.0", "150.0"]
    # Stock computes full windows: 8 x 128 tokens an iteration, every one real.
    assert rows["tokens/s (real)"] == ["6000", "3000", "6827"]
    assert rows["fill"][2] == "1.000" and rows["padded tokens"][2] == "0"
    assert "dynamic / stock real tokens per second (iterations 2+): 0.88x" in out
    # Without --stock the table has two columns, as before.
    assert compare_runs.main([str(a) for a in argv]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == ["dynamic", "fixed"]
