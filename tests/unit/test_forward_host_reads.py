"""The forward step reads a THD micro-batch's boundaries from its host copy (no device sync).

On CUDA the Megatron-LM entry moves each micro-batch to the device before the forward; the
longest segment (``max_seqlen``) and the padded-row checks then read the copy still in host
memory. Here the "device" copy lives on torch's ``meta`` device, whose values cannot be read:
any read of it fails, so these tests fail if the step reads the moved copy.
"""

import pytest
import torch

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

apply_cpu_shim()  # importing megatron.core needs the triton stand-in on this machine

from megatron_dynbatch.mcore.forward import _attention  # noqa: E402

pytestmark = pytest.mark.unit


def _packed(rows=1):
    cu = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2]] * rows)
    return {"tokens": torch.zeros(rows, 12, dtype=torch.int64), "cu_seqlens": cu,
            "segment_ids": segments}  # fmt: skip


def _on_meta(batch):
    return {key: value.to("meta") for key, value in batch.items()}


def test_packed_row_boundaries_are_read_from_the_host_copy():
    host = _packed()
    mask, params = _attention(_on_meta(host), True, host)
    assert mask is None
    assert params.max_seqlen_q == params.max_seqlen_kv == 5
    assert params.cu_seqlens_q.device.type == "meta"  # the kernel gets the device copy
    with pytest.raises(Exception):  # noqa: B017 - the meta copy cannot be read: what is shown
        _attention(_on_meta(host), True)


def test_padded_rows_are_checked_on_the_host_copy():
    host = _packed(rows=2)
    host["segment_ids"] = torch.tensor([[0] * 10 + [1] * 2, [0] * 12])
    assert _attention(_on_meta(host), True, host) == (None, None)
    host["segment_ids"][0, :3] = 2  # several samples in a row: refused, from the host copy
    with pytest.raises(ValueError, match="reached THD attention"):
        _attention(_on_meta(host), True, host)
