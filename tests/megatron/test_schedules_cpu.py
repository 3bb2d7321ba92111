"""Real Megatron-Core schedules on CPU/gloo give the gradients of a single-process reference.

Fixed micro-batching (no planner): packed rows of several samples, uneven loss-token counts per
micro-batch and one micro-batch whose loss mask is all zero. Every layout (no pipelining, 1F1B,
interleaved 1F1B; dp = 1 and 2) must reproduce the gradient of
``sum(masked token losses) / total masked tokens`` over the global batch.
"""

import pytest
import torch

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

# Explicit, before the first megatron import (this module is also imported by the test workers).
apply_cpu_shim()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402

from megatron_dynbatch.errors import DynBatchValueError  # noqa: E402
from megatron_dynbatch.mcore.forward import (  # noqa: E402
    build_attention_mask,
    make_forward_step,
)
from megatron_dynbatch.mcore.schedule import (  # noqa: E402
    check_schedule_config,
    run_forward_backward,
)
from megatron_dynbatch.tools.testing.tiny_gpt import (  # noqa: E402
    TINY_VOCAB_SIZE,
    build_tiny_gpt,
    logprobs_from_logits,
    make_schedule_config_safe,
    named_global_grads,
    tiny_transformer_config,
    wrap_in_ddp,
)
from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks  # noqa: E402

pytestmark = pytest.mark.gloo

SEQ_LENGTH = 16
MICRO_BATCH_SIZE = 2
NUM_MICROBATCHES = 4  # per data-parallel rank; interleaving at pp=2 needs a multiple of 2
SEED = 7
REL_TOL = 1e-5


# ---------------------------------------------------------------------------------------------
# Data: packed micro-batches, deterministic from a seed.
# ---------------------------------------------------------------------------------------------


def _packed_row(generator: torch.Generator, samples: list[tuple[int, int]]) -> dict:
    """One packed row; ``samples`` holds (length, prompt_length) pairs, prompts carry no loss."""
    row = {
        "tokens": torch.zeros(SEQ_LENGTH, dtype=torch.int64),
        "position_ids": torch.zeros(SEQ_LENGTH, dtype=torch.int64),
        "segment_ids": torch.full((SEQ_LENGTH,), len(samples), dtype=torch.int64),
        "labels": torch.zeros(SEQ_LENGTH, dtype=torch.int64),
        "loss_mask": torch.zeros(SEQ_LENGTH, dtype=torch.float32),
    }
    offset = 0
    for segment, (length, prompt_length) in enumerate(samples):
        span = slice(offset, offset + length)
        row["tokens"][span] = torch.randint(0, TINY_VOCAB_SIZE, (length,), generator=generator)
        row["labels"][span] = torch.randint(0, TINY_VOCAB_SIZE, (length,), generator=generator)
        row["position_ids"][span] = torch.arange(length)
        row["segment_ids"][span] = segment
        row["loss_mask"][offset + prompt_length : offset + length] = 1.0
        offset += length
    assert offset <= SEQ_LENGTH
    # The padding tail restarts its positions too (it is its own segment, attending to itself).
    row["position_ids"][offset:] = torch.arange(SEQ_LENGTH - offset)
    return row


def _make_microbatches(seed: int, *, zero_loss_index: int | None = None) -> list[dict]:
    """``NUM_MICROBATCHES`` micro-batches of random packed rows with uneven loss-token counts."""
    generator = torch.Generator().manual_seed(seed)
    microbatches = []
    for index in range(NUM_MICROBATCHES):
        rows = []
        for _ in range(MICRO_BATCH_SIZE):
            samples, used = [], 0
            while True:
                length = int(torch.randint(2, 9, (1,), generator=generator))
                if used + length > SEQ_LENGTH:
                    break
                prompt_length = int(torch.randint(0, length, (1,), generator=generator))
                if index == zero_loss_index:
                    prompt_length = length
                samples.append((length, prompt_length))
                used += length
            rows.append(_packed_row(generator, samples))
        microbatches.append({key: torch.stack([row[key] for row in rows]) for key in rows[0]})
    return microbatches


def _dp_microbatches(dp_rank: int) -> list[dict]:
    # Data-parallel rank 0 gets one micro-batch without loss tokens.
    return _make_microbatches(SEED + dp_rank, zero_loss_index=1 if dp_rank == 0 else None)


def _token_loss(batch: dict, per_token_loss: torch.Tensor):
    """The 3-tuple loss of ``calculate_per_token_loss=True``: (sum, token count, logging)."""
    loss_mask = batch["loss_mask"]
    loss_sum = (per_token_loss * loss_mask).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), loss_mask.sum()])}


# ---------------------------------------------------------------------------------------------
# Bodies run on the worker ranks.
# ---------------------------------------------------------------------------------------------


def _config_for_current_layout(**kwargs):
    return tiny_transformer_config(
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=(
            parallel_state.get_virtual_pipeline_model_parallel_world_size()
        ),
        **kwargs,
    )


def _reference_grads_body(num_dp: int) -> dict:
    """Plain autograd on one process over the whole global batch (no schedule, no DDP)."""
    [model] = build_tiny_gpt(tiny_transformer_config())
    microbatches = [mb for dp_rank in range(num_dp) for mb in _dp_microbatches(dp_rank)]
    total_tokens = sum(mb["loss_mask"].sum() for mb in microbatches)
    loss_sum = 0.0
    for mb in microbatches:
        mask = build_attention_mask(mb["segment_ids"])
        per_token = model(mb["tokens"], mb["position_ids"], mask, labels=mb["labels"])
        loss_sum = loss_sum + (per_token * mb["loss_mask"]).sum()
    (loss_sum / total_tokens).backward()
    return {"grads": named_global_grads([model]), "loss_sum": loss_sum.item()}


def _train_step_body() -> dict:
    """One training step through Megatron's schedule, DDP and finalize_model_grads."""
    config = _config_for_current_layout(calculate_per_token_loss=True)
    config.finalize_model_grads_func = finalize_model_grads
    chunks = wrap_in_ddp(build_tiny_gpt(config))
    microbatches = _dp_microbatches(parallel_state.get_data_parallel_rank())
    losses = run_forward_backward(
        chunks,
        microbatches,
        forward_step=make_forward_step(_token_loss),
        seq_length=SEQ_LENGTH,
        micro_batch_size=MICRO_BATCH_SIZE,
    )
    return {
        "grads": named_global_grads(chunks),
        "losses": [entry["lm loss"] for entry in losses],
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "is_last_stage": parallel_state.is_pipeline_last_stage(ignore_virtual=True),
    }


def _logprobs_body(forward_only_pipeline: bool, collect_non_loss_data: bool = True) -> list:
    """Per-token log-probs of dp rank 0's micro-batches (schedule, or logits + log_softmax)."""
    microbatches = _dp_microbatches(0)
    if not forward_only_pipeline:
        [model] = build_tiny_gpt(tiny_transformer_config())
        with torch.no_grad():
            return [
                logprobs_from_logits(
                    model(
                        mb["tokens"], mb["position_ids"], build_attention_mask(mb["segment_ids"])
                    ),
                    mb["labels"],
                )
                for mb in microbatches
            ]
    chunks = build_tiny_gpt(_config_for_current_layout())
    outputs = run_forward_backward(
        chunks,
        microbatches,
        forward_step=make_forward_step(collect_logprobs=True),
        seq_length=SEQ_LENGTH,
        micro_batch_size=MICRO_BATCH_SIZE,
        forward_only=True,
        collect_non_loss_data=collect_non_loss_data,
    )
    return [entry["logprobs"] for entry in outputs]


def _packing_isolation_body() -> dict:
    """Logits and losses of two samples packed in one row vs. each sample in a row of its own."""
    [model] = build_tiny_gpt(tiny_transformer_config())
    model.eval()
    generator = torch.Generator().manual_seed(SEED)
    lengths = (6, 7)
    packed = _packed_row(generator, [(length, 0) for length in lengths])
    results = {"packed": {}, "alone": [], "unmasked_logits": None}
    batch = {key: value.unsqueeze(0) for key, value in packed.items()}

    def run(batch, mask):
        with torch.no_grad():
            logits = model(batch["tokens"], batch["position_ids"], mask)
            loss = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
        return logits[0], loss[0]

    packed_ids = batch["segment_ids"]
    results["packed"] = run(batch, build_attention_mask(packed_ids))
    # Plain causal attention across the whole row, to show the mask is actually applied.
    results["unmasked_logits"] = run(batch, build_attention_mask(torch.zeros_like(packed_ids)))[0]
    offset = 0
    for length in lengths:
        alone = {key: torch.zeros_like(value) for key, value in batch.items()}
        for key in ("tokens", "labels", "position_ids"):
            alone[key][0, :length] = batch[key][0, offset : offset + length]
        alone["segment_ids"][0, length:] = 1
        alone["position_ids"][0, length:] = torch.arange(SEQ_LENGTH - length)
        logits, loss = run(alone, build_attention_mask(alone["segment_ids"]))
        results["alone"].append((offset, length, logits[:length], loss[:length]))
        offset += length
    return results


# ---------------------------------------------------------------------------------------------
# Tests (run in the pytest process, bodies on the worker ranks).
# ---------------------------------------------------------------------------------------------


def _assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    error = (actual - expected).norm() / expected.norm().clamp_min(1e-30)
    assert error <= REL_TOL, f"{what}: relative error {error:.3e} > {REL_TOL}"


_REFERENCE_CACHE: dict[int, dict] = {}


def _reference(num_dp: int) -> dict:
    if num_dp not in _REFERENCE_CACHE:
        [_REFERENCE_CACHE[num_dp]] = run_on_ranks(1, _reference_grads_body, num_dp, layout=Layout())
    return _REFERENCE_CACHE[num_dp]


@pytest.mark.parametrize("num_dp", [1, 2], ids=lambda dp: f"dp{dp}")
@pytest.mark.parametrize(
    "layout",
    [Layout(pp=1), Layout(pp=2), Layout(pp=2, vpp=2)],
    ids=["no_pipelining", "1f1b", "interleaved"],
)
def test_schedule_grads_match_single_process_reference(layout: Layout, num_dp: int):
    reference = _reference(num_dp)
    world_size = layout.pp * num_dp
    results = run_on_ranks(world_size, _train_step_body, layout=layout)

    # Every data-parallel replica holds the same reduced gradients; pipeline stages hold disjoint
    # parameters that together cover the model.
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        for name, grad in result["grads"].items():
            if name in merged:
                torch.testing.assert_close(grad, merged[name], rtol=0, atol=0)
            merged[name] = grad
    assert merged.keys() == reference["grads"].keys()
    for name, expected in reference["grads"].items():
        _assert_rel_close(merged[name], expected, name)

    # The logged per-micro-batch loss sums add up to the reference's, with the empty micro-batch.
    logged = [loss for r in results if r["is_last_stage"] for loss in r["losses"]]
    assert len(logged) == NUM_MICROBATCHES * num_dp
    assert any(float(loss[1]) == 0.0 for loss in logged)
    assert len({float(loss[1]) for loss in logged}) > 2, "micro-batches should be uneven"
    total = sum(float(loss[0]) for loss in logged)
    assert abs(total - reference["loss_sum"]) <= REL_TOL * abs(reference["loss_sum"])


_LOGPROBS_CACHE: dict[str, list] = {}


@pytest.mark.parametrize("collect_non_loss_data", [True, False], ids=["non_loss", "3tuple"])
@pytest.mark.parametrize("layout", [Layout(pp=2), Layout(pp=2, vpp=2)], ids=["1f1b", "interleaved"])
def test_forward_only_logprobs_match_log_softmax(layout: Layout, collect_non_loss_data: bool):
    if not _LOGPROBS_CACHE:  # one process's log-probs, the same for the four cases
        [_LOGPROBS_CACHE["expected"]] = run_on_ranks(1, _logprobs_body, False, layout=Layout())
    expected = _LOGPROBS_CACHE["expected"]
    results = run_on_ranks(
        layout.pp, _logprobs_body, True, collect_non_loss_data=collect_non_loss_data, layout=layout
    )
    assert results[0] == [], "log-probs are collected on the last stage only"
    actual = results[-1]
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_samples_do_not_attend_across_segments():
    [result] = run_on_ranks(1, _packing_isolation_body, layout=Layout())
    packed_logits, packed_loss = result["packed"]
    for offset, length, logits, loss in result["alone"]:
        span = slice(offset, offset + length)
        torch.testing.assert_close(packed_logits[span], logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(packed_loss[span], loss, rtol=0, atol=1e-5)
    # With a plain causal mask instead, the second sample sees the first one.
    second = slice(6, 13)
    assert not torch.allclose(result["unmasked_logits"][second], packed_logits[second], atol=1e-4)


def test_build_attention_mask_is_block_diagonal_causal():
    mask = build_attention_mask(torch.tensor([[0, 0, 1, 1, 2]]))
    allowed = ~mask[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.bool
    assert torch.equal(allowed, expected)


def test_interleaved_pp2_with_batched_p2p_is_refused():
    with pytest.raises(DynBatchValueError, match="batch_p2p_comm=True"):
        tiny_transformer_config(
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            batch_p2p_comm=True,
        )
    config = tiny_transformer_config(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    assert config.batch_p2p_comm is False
    config.batch_p2p_comm = True
    with pytest.raises(DynBatchValueError, match="pipeline_model_parallel_size=2"):
        check_schedule_config(config)
    assert make_schedule_config_safe(config).batch_p2p_comm is False
    # Without interleaving, or with more stages, batched p2p stays allowed.
    check_schedule_config(
        tiny_transformer_config(pipeline_model_parallel_size=2, batch_p2p_comm=True)
    )
    check_schedule_config(
        tiny_transformer_config(
            pipeline_model_parallel_size=4,
            virtual_pipeline_model_parallel_size=1 + 1,
            num_layers=8,
            batch_p2p_comm=True,
        )
    )


def test_interleaved_pp2_with_variable_lengths_needs_overlapped_p2p():
    # slime's setting (variable_seq_lengths) hangs at pp = 2 with interleaving unless p2p overlaps.
    config = tiny_transformer_config(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    config.variable_seq_lengths = True
    with pytest.raises(DynBatchValueError, match="overlap_p2p_comm=False") as raised:
        check_schedule_config(config)
    assert "virtual_pipeline_model_parallel_size=2" in str(raised.value)
    assert make_schedule_config_safe(config).overlap_p2p_comm is True
    check_schedule_config(config)
    # Fixed shapes, or no interleaving, need no overlap.
    config.variable_seq_lengths = False
    config.overlap_p2p_comm = False
    check_schedule_config(config)
    plain = tiny_transformer_config(pipeline_model_parallel_size=2)
    plain.variable_seq_lengths = True
    check_schedule_config(plain)


def test_cpu_shim_is_idempotent_and_local_to_megatron_modules():
    from megatron.core.pipeline_parallel import schedules

    apply_cpu_shim()
    apply_cpu_shim()
    assert schedules.torch is not torch, "schedules should see the CPU proxy"
    assert schedules.torch.zeros([], device="cuda").device.type == "cpu"
    # Everyone else keeps the real torch: a cuda request outside Megatron still fails.
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros([], device="cuda")
