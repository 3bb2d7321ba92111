"""A local error on one rank becomes the same clear error on every rank, before any p2p."""

import time

import pytest

from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks
from tests._support import FAIL_FAST_S

pytestmark = pytest.mark.gloo


def _failing_rank_body(failing_rank):
    import torch.distributed as dist

    from megatron_dynbatch.mcore.agreement import StepAgreementError, step_agreement
    from megatron_dynbatch.planning import PlannerConfig, plan_schedule

    started = time.monotonic()
    try:
        with step_agreement(what="step 0") as agreement:
            plan = plan_schedule([10, 20, 30], config=PlannerConfig(max_tokens_per_gpu=64))
            agreement.fingerprint = plan.fingerprint()
            if dist.get_rank() == failing_rank:
                raise ValueError("sample 0: prompt_length=99 is greater than its total length=10")
    except StepAgreementError as error:
        return type(error).__name__, str(error), time.monotonic() - started, error.__cause__
    return None


def test_one_ranks_error_stops_every_rank_with_the_same_message():
    results = run_on_ranks(2, _failing_rank_body, 1, layout=Layout())
    names = {name for name, _, _, _ in results}
    messages = {message for _, message, _, _ in results}
    assert names == {"StepAgreementError"} and len(messages) == 1, results
    [message] = messages
    assert "1 of 2 rank(s) failed" in message and "(step 0)" in message
    assert "rank 1: ValueError: sample 0: prompt_length=99" in message
    assert all(elapsed < FAIL_FAST_S for _, _, elapsed, _ in results)
    # The failing rank keeps its own exception as the cause; the other has none.
    assert results[0][3] is None and isinstance(results[1][3], ValueError)


def test_no_error_when_every_rank_succeeds():
    assert run_on_ranks(2, _failing_rank_body, -1, layout=Layout()) == [None, None]
