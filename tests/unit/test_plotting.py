"""`megatron-dynbatch plan --plot` writes a real PNG; matplotlib stays out of the planner."""

import json
import subprocess
import sys

import pytest

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: A two-panel figure with bars and timeline boxes is tens of KB; an empty canvas is a few KB.
MIN_PNG_BYTES = 20_000


def _samples(tmp_path):
    """Three GRPO-like groups of four plus loose samples: several micro-batches per rank."""
    data = []
    for group, base in enumerate((300, 900, 2500)):
        for k in range(4):
            data.append({"length": base + 97 * k, "rollout": f"g{group}", "prompt_length": 120})
    data += [64, 1500, 700, 3000, 220, 1800]
    path = tmp_path / "samples.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    "layout_args",
    [
        ["--dp-size", "2", "--pp-size", "2", "--vpp-size", "2"],
        ["--dp-size", "3", "--pp-size", "3", "--layout", "padded"],
    ],
    ids=["packed-interleaved", "padded-1f1b"],
)
def test_plan_plot_writes_png(tmp_path, layout_args):
    out = tmp_path / "step.png"
    cmd = [sys.executable, "-m", "megatron_dynbatch.cli", "plan", _samples(tmp_path)]
    cmd += layout_args + ["--max-tokens-per-gpu", "4096", "--plot", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "layout=" in proc.stdout  # the table is still printed
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > MIN_PNG_BYTES, f"PNG of {len(data)} bytes looks empty"


def test_plot_step_caps_drawn_ranks_and_checks_step(tmp_path):
    from megatron_dynbatch.planning import ParallelLayout, PlannerConfig, SampleSet, plan_samples
    from megatron_dynbatch.plotting import plot_step

    samples = SampleSet.build([500 + 37 * i for i in range(200)])
    config = PlannerConfig(max_tokens_per_gpu=4096, parallel=ParallelLayout(dp_size=40))
    plan = plan_samples(samples, config)
    out = tmp_path / "wide.png"
    plot_step(plan, 0, samples, config, str(out), max_ranks=8)
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="step_index=1"):
        plot_step(plan, 1, samples, config, str(tmp_path / "x.png"))


def test_cli_and_planner_import_without_matplotlib():
    code = (
        "import sys\n"
        "import megatron_dynbatch.cli, megatron_dynbatch.planning\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib')\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
