"""`megatron-dynbatch plan --plot` writes a real PNG of the planned step; the picture is drawn from
the plan (checked through the data `plot_step` returns); matplotlib stays out of the planner."""

import json
import subprocess
import sys

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.planning import (
    CostModel,
    ParallelLayout,
    PlannerConfig,
    SampleSet,
    plan_samples,
)
from megatron_dynbatch.planning.simulate import pipeline_makespan
from megatron_dynbatch.planning.spec import ATTENTION_CROSSOVER_7B
from megatron_dynbatch.tools.plotting import microbatch_costs, plot_step

pytestmark = pytest.mark.unit

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _data():
    """Three GRPO-like groups of four plus loose samples: several micro-batches per rank."""
    data = []
    for group, base in enumerate((300, 900, 2500)):
        for k in range(4):
            data.append({"length": base + 97 * k, "rollout": f"g{group}", "prompt_length": 120})
    data += [64, 1500, 700, 3000, 220, 1800]
    return data


@pytest.mark.parametrize(
    "layout_args",
    [
        ["--dp-size", "2", "--pp-size", "2", "--vpp-size", "2"],
        ["--dp-size", "3", "--pp-size", "3", "--layout", "padded"],
    ],
    ids=["packed-interleaved", "padded-1f1b"],
)
def test_plan_plot_writes_png(tmp_path, layout_args):
    path = tmp_path / "samples.json"
    path.write_text(json.dumps(_data()))
    out = tmp_path / "step.png"
    cmd = [sys.executable, "-m", "megatron_dynbatch.tools.cli", "plan", str(path)]
    cmd += layout_args + ["--max-tokens-per-gpu", "4096", "--plot", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "layout=" in proc.stdout  # the table is still printed
    assert out.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize(
    "layout, parallel",
    [
        ("packed", ParallelLayout(dp_size=2, pp_size=2, vpp_size=2)),
        ("padded", ParallelLayout(dp_size=3, pp_size=3)),
    ],
)
def test_plot_draws_the_plan_under_the_cap_and_its_simulated_pipeline(tmp_path, layout, parallel):
    samples = SampleSet.build(
        [d["length"] if isinstance(d, dict) else d for d in _data()],
        [d.get("rollout") if isinstance(d, dict) else None for d in _data()],
    )
    cost = CostModel(attention_weight=1.0 / ATTENTION_CROSSOVER_7B)
    config = PlannerConfig(max_tokens_per_gpu=4096, parallel=parallel, layout=layout, cost=cost)
    plan = plan_samples(samples, config)
    step = plan.steps[0]
    picture = plot_step(plan, 0, samples, config, str(tmp_path / "step.png"))
    assert picture.token_cap == plan.token_cap == 4096
    assert picture.ranks == tuple(range(parallel.dp_size))
    assert len(picture.bars) == parallel.dp_size * step.num_microbatches
    footprint = step.micro_batch_size * step.seq_length
    for rank, m, real, padding, placeholder in picture.bars:
        mb = step.ranks[rank][m]
        assert real == sum(samples.lengths[i] for i in mb)
        assert real + padding + placeholder == footprint  # every bar is one full [B, S] row
        assert (placeholder > 0) == (not mb)
        assert real + padding <= picture.token_cap  # no sample is oversize here
    # The timeline is rank 0's step as the planner scores it: the one cost model, simulated.
    expected = pipeline_makespan(
        microbatch_costs(plan, 0, samples, config, 0),
        parallel.pp_size,
        parallel.vpp_size,
        parallel.microbatch_group_size_per_vp_stage,
    )
    assert picture.timeline.makespan == pytest.approx(expected)
    assert {e.microbatch for e in picture.timeline.events} == set(range(step.num_microbatches))


def test_plot_step_caps_drawn_ranks_and_checks_step(tmp_path):
    samples = SampleSet.build([500 + 37 * i for i in range(200)])
    config = PlannerConfig(max_tokens_per_gpu=4096, parallel=ParallelLayout(dp_size=40))
    plan = plan_samples(samples, config)
    out = tmp_path / "wide.png"
    picture = plot_step(plan, 0, samples, config, str(out), max_ranks=8)
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    assert picture.ranks == tuple(range(8))
    with pytest.raises(DynBatchValueError, match="step_index=1"):
        plot_step(plan, 1, samples, config, str(tmp_path / "x.png"))


def test_cli_and_planner_import_without_matplotlib():
    code = (
        "import sys\n"
        "import megatron_dynbatch.tools.cli, megatron_dynbatch.planning\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib')\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
