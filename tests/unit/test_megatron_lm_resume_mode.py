"""A checkpoint resumed in the launch script's other data unit is refused by name (resume.py)."""

from types import SimpleNamespace

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.megatron_lm.resume import (
    check_resumed_mode,
    check_resumed_order,
    refuse_resume_in_another_mode,
)

pytestmark = pytest.mark.unit

_STOCK = SimpleNamespace(consumed_train_samples=40)  # saved by stock Megatron: neither flag
_DYNAMIC = SimpleNamespace(use_dynamic_batch_size=True, document_samples=False)
_DOCUMENTS = SimpleNamespace(use_dynamic_batch_size=False, document_samples=True)
_WINDOWS = SimpleNamespace(use_dynamic_batch_size=False, document_samples=False)


def _saved(run, consumed=40):
    return SimpleNamespace(**vars(run), consumed_train_samples=consumed)


def test_a_checkpoint_of_the_other_unit_is_refused_with_both_fixes():
    cases = [
        (_STOCK, _DYNAMIC, "drop --use-dynamic-batch-size"),
        (_saved(_WINDOWS), _DOCUMENTS, "drop --use-dynamic-batch-size"),
        (_saved(_DYNAMIC), _WINDOWS, "add --document-samples"),
        (_saved(_DOCUMENTS), _WINDOWS, "add --document-samples"),
    ]
    for saved, now, fix in cases:
        with pytest.raises(DynBatchValueError, match="40 consumed samples") as caught:
            check_resumed_mode(saved, SimpleNamespace(**vars(now), load="ckpt"))
        message = str(caught.value)
        assert fix in message and "--finetune" in message and "--load ckpt" in message, message


def test_the_same_unit_or_nothing_consumed_resumes():
    # Dynamic and --document-samples read the same samples in the same order: either resumes
    # the other exactly.
    for saved, now in [(_saved(_DYNAMIC), _DOCUMENTS), (_saved(_DOCUMENTS), _DYNAMIC)]:
        check_resumed_mode(saved, now)
    check_resumed_mode(_STOCK, _WINDOWS)
    check_resumed_mode(_saved(_WINDOWS, consumed=0), _DYNAMIC)  # nothing read yet


def test_megatrons_check_is_wrapped_once_and_still_runs():
    seen = []
    checkpointing = SimpleNamespace(check_checkpoint_args=lambda a, skip_args=None: seen.append(a))
    args = SimpleNamespace(**vars(_DYNAMIC), load="ckpt")
    refuse_resume_in_another_mode(checkpointing, args)
    wrapped = checkpointing.check_checkpoint_args
    refuse_resume_in_another_mode(checkpointing, args)  # a second call wraps nothing more
    assert checkpointing.check_checkpoint_args is wrapped
    same = _saved(_DOCUMENTS)
    wrapped(same, skip_args=None)
    assert seen == [same]  # Megatron's own check ran after ours
    with pytest.raises(DynBatchValueError, match="Resume in the mode it was saved in"):
        wrapped(_STOCK)
    assert seen == [same]


def _documents_run(**over):
    values = dict(
        vars(_DYNAMIC),
        seed=1234,
        split="80,20,0",
        seq_length=256,
        data_path=["/data/a/tiny_text_document"],
        mock_data=False,
        load="ckpt",
    )
    values.update(over)
    return SimpleNamespace(**values)


@pytest.mark.parametrize(
    "change, said, fix",
    [
        ({"seed": 99}, "--seed '1234' (now '99')", "(--seed 1234)"),
        ({"split": "90,10,0"}, "--split '80,20,0' (now '90,10,0')", "(--split 80,20,0)"),
        ({"seq_length": 128}, "--seq-length '256' (now '128')", "(--seq-length 256)"),
        ({"data_path": ["/data/b/other_document"]}, "--data-path", "/data/a/tiny_text_document"),
        ({"mock_data": True}, "--mock-data 'False' (now 'True')", "(without --mock-data)"),
    ],
)
def test_a_documents_run_resumed_in_another_order_is_refused_naming_the_saved_values(
    change, said, fix
):
    """A probe: resumed with another --seed, --split or --seq-length, 9 to 17 of the epoch's
    next 27 samples had been trained before the stop, and nothing was said."""
    saved = _saved(_documents_run(), consumed=32)
    with pytest.raises(DynBatchValueError, match="had read 32 samples") as caught:
        check_resumed_order(saved, _documents_run(**change))
    message = str(caught.value)
    assert said in message and fix in message and "--finetune" in message, message
    # The saved values resume; so does the same data read from another directory.
    check_resumed_order(saved, _documents_run())
    check_resumed_order(saved, _documents_run(data_path=["/moved/tiny_text_document"]))


def test_the_order_is_not_checked_where_nothing_was_read_or_windows_are_read():
    check_resumed_order(_saved(_documents_run(), consumed=0), _documents_run(seed=5))
    windows = SimpleNamespace(**{**vars(_documents_run()), "use_dynamic_batch_size": False})
    check_resumed_order(_saved(windows), SimpleNamespace(**{**vars(windows), "seed": 5}))
