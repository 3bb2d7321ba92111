"""``adapters.slime.build_dp_schedule`` against slime's own: its real function on the static path
and its own test module (``tests/test_dp_schedule.py``) run against ours.

Needs a slime checkout at the pinned commit in ``SLIME_DIR`` (skipped without one, in
tests/conftest.py); the checks without slime are tests/unit/test_slime_dp_schedule.py.
"""

import os
import pathlib
import sys
import warnings

import numpy as np
import pytest

from megatron_dynbatch.adapters.slime import build_dp_schedule
from megatron_dynbatch.planning import OversizeSampleWarning
from tests._support import slime_args, slime_tp

pytestmark = pytest.mark.slime

SLIME_DIR = os.environ.get("SLIME_DIR")


def _slime_module(name):
    if SLIME_DIR not in sys.path:
        sys.path.insert(0, SLIME_DIR)
    import importlib

    return importlib.import_module(name)


@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_static_path_equals_slimes_function(seed, balance):
    slime_schedule = _slime_module("slime.utils.dp_schedule").build_dp_schedule
    rng = np.random.default_rng(seed)
    dp = int(rng.choice([1, 2, 4]))
    vpp = int(rng.choice([1, 2]))
    group = 2 if vpp > 1 else 1
    mbs = int(rng.choice([1, 2, 3]))
    per_step = dp * group * mbs * int(rng.integers(1, 4))
    num_steps = int(rng.integers(1, 4))
    n = per_step * num_steps + int(rng.integers(0, 3))
    lengths = [int(x) for x in rng.integers(1, 4000, size=n)]
    args = slime_args(use_dynamic_batch_size=False, micro_batch_size=mbs, balance_data=balance)
    tp = slime_tp(dp_size=dp, vpp_size=vpp, microbatch_group_size_per_vp_stage=group)
    kwargs = dict(global_batch_size=per_step, rollout_indices=list(range(n)))
    theirs = slime_schedule(args, tp, lengths, **kwargs)
    ours = build_dp_schedule(args, tp, lengths, **kwargs)
    assert tuple(ours) == tuple(theirs)


def test_slimes_own_tests_pass_except_the_documented_differences():
    source = (pathlib.Path(SLIME_DIR) / "tests" / "test_dp_schedule.py").read_text()
    source = source.replace(
        "from slime.utils.dp_schedule import build_dp_schedule",
        "from megatron_dynbatch.adapters.slime import build_dp_schedule",
    )
    namespace = {"__name__": "slime_test_dp_schedule_on_ours"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)  # slime's "unit" mark
        exec(compile(source, "slime/tests/test_dp_schedule.py", "exec"), namespace)
    deliberate = {
        # We train trailing rollouts and short steps instead of trimming or asserting.
        "test_trims_trailing_rollouts_that_dont_fill_a_step",
        "test_rejects_when_fewer_rollouts_than_gbs",
    }
    tests = sorted(k for k in namespace if k.startswith("test_"))
    assert len(tests) >= 9
    failed = []
    for name in tests:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", OversizeSampleWarning)
                namespace[name]()
        except (AssertionError, pytest.fail.Exception):
            failed.append(name)
    assert set(failed) == deliberate
