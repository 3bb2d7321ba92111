"""Megatron's rerun state machine checkpoints the replay buffers of the data iterators it is given
(``--rerun-mode validate_results``, the default, with ``torch_dist`` checkpoints) when a result it
cannot reproduce asks for a checkpoint and a restart. Under dynamic batching it replays the step's
materialized micro-batches; the batch iterator the hook reads keeps no buffer, since a lazy
batch's loader is a closure over the whole split (a probe's rerun checkpoint failed to pickle it
and left a half-written checkpoint where ``--document-samples`` exited 16 with one)."""

import pickle

import pytest

pytestmark = pytest.mark.unit


def test_the_batch_iterator_keeps_no_replay_buffer_for_a_rerun_checkpoint():
    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

    apply_cpu_shim()  # the hooks import megatron.core, which needs the triton stand-in here
    from megatron.core import rerun_state_machine as rerun
    from megatron.core.rerun_state_machine import RerunDataIterator, RerunMode

    from megatron_dynbatch.integrations.megatron_lm.hooks import _next_batch
    from megatron_dynbatch.runtime.batches import LazyRolloutBatch

    splits = {"handle": open(__file__)}  # what a split holds: nothing pickle takes
    batches = [
        LazyRolloutBatch(sample_lengths=[3, 5], load_sample=lambda i: splits[i]) for _ in range(3)
    ]
    outer = RerunDataIterator(iter(batches))
    before = rerun._GLOBAL_RERUN_STATE_MACHINE
    # Megatron's default mode (the global is set directly: its setter refuses to replace one).
    rerun._GLOBAL_RERUN_STATE_MACHINE = rerun.RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    try:
        for step in range(2):
            assert _next_batch(outer, "training").sample_lengths == [3, 5]
            state = outer.state_dict()
            assert state["saved_microbatches"] == [] and not state["replaying"], step
            pickle.dumps(state)  # as torch_dist's ShardedObject does
    finally:
        rerun._GLOBAL_RERUN_STATE_MACHINE = before
        splits["handle"].close()
