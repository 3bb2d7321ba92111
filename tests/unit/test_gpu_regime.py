"""The GPU-regime benchmark's pieces (issue 35): verl kept within the cap, and measured weights
replacing the assumed ones."""

import json
import random

import pytest

from benchmarks import gpu_regime
from benchmarks.baselines import BaselineFailure, verl_kk

pytestmark = pytest.mark.unit


def test_verl_kept_within_the_cap_never_exceeds_it_and_adds_micro_batches_only_where_needed():
    rng = random.Random(0)
    raised = 0
    for _ in range(40):
        cap = rng.choice([2048, 4096])
        dp = rng.choice([1, 2, 4])
        lengths = [rng.randint(1, cap) for _ in range(dp * rng.randint(2, 24))]
        try:
            plain = verl_kk(lengths, dp_size=dp, token_cap=cap)
            kept = verl_kk(lengths, dp_size=dp, token_cap=cap, keep_cap=True)
        except BaselineFailure:
            continue
        for rank in kept:
            for mb in rank:
                assert len(mb) == 1 or sum(lengths[i] for i in mb) <= cap
        over = any(len(mb) > 1 and sum(lengths[i] for i in mb) > cap for r in plain for mb in r)
        assert (len(kept[0]) > len(plain[0])) == over
        raised += over
    assert raised  # the case the option exists for occurred


def test_measured_weights_replace_the_assumed_ones(tmp_path):
    case = gpu_regime.cases(0)[0]
    assumed = gpu_regime.true_cost(case, gpu_regime.Assumptions())
    path = tmp_path / "weights.json"
    path.write_text(
        json.dumps(
            {
                "linear_tflops": 300.0,
                "models": {
                    "32b": {
                        "token_weight": 2.0,
                        "attention_weight": 1e-4,
                        "microbatch_overhead": 5.0,
                    }
                },
            }
        )
    )
    rates, weights = gpu_regime._load_weights(str(path))
    slower = gpu_regime.true_cost(case, rates, weights)  # 7b: the rates
    assert case.model == "7b" and slower.token_weight > 1.9 * assumed.token_weight
    big = next(c for c in gpu_regime.cases(0) if c.model == "32b")
    given = gpu_regime.true_cost(big, rates, weights)
    assert (given.token_weight, given.attention_weight, given.overhead) == (2.0, 1e-4, 5.0)
