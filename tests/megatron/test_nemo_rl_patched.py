"""NeMo-RL's own Megatron policy code, patched by ``patches/nemo_rl``, against a per-sample reference.

With ``NEMO_RL_DIR`` (a NeMo-RL checkout at the commit named in ``patches/nemo_rl/README.md``) the
patches are applied to a copy with ``launch/apply_nemo_rl_patches.sh``; then, on gloo CPU ranks
(tiny GPT, pp 2 at dp 1 and 2, pp 2 x vpp 2, and global batches of one sample at dp 2, so one rank
holds only placeholders), NeMo-RL's real code runs the step as its driver and Megatron worker do:

* the driver's ``Policy._shard_for_train`` / ``_shard_for_logprob`` (patch 0002) shard the batch;
* each rank runs the worker's training loop body: ``BatchedDataDict.get_batch``,
  ``process_global_batch`` (``global_valid_seqs`` / ``global_valid_toks`` all-reduced over DP),
  ``get_microbatch_iterator`` (NeMo-RL's sequence packing: THD rows, padded to the rank's largest
  pack at pp > 1), ``LossPostProcessor`` with NeMo-RL's ``NLLLossFn`` and
  ``megatron_forward_backward`` (patch 0004 hands the interleaved schedule one iterator per chunk);
* the log-prob pass runs ``get_microbatch_iterator``, ``LogprobsPostProcessor`` and
  ``megatron_forward_backward`` forward-only, drops placeholder rows as patched ``get_logprobs``
  does (patch 0003, ``drop_placeholder_rows``), and the driver's ``BatchedDataDict.from_batches``
  and ``reorder_data`` put them back in sample order.

Checked: gradients equal a single process running each sample alone (relative 1e-5), log-probs
come back in sample order (absolute 1e-5), every DP rank runs the same number of micro-batches (a
multiple of the interleaving group), placeholders add nothing to ``global_valid_seqs`` /
``global_valid_toks``. With the switch off the patched tree shards exactly as the stock one, and
NeMo-RL's own CPU tests of ``BatchedDataDict`` sharding and of its packing algorithms pass on the
patched tree as on the pristine one.

What is not NeMo-RL's in these runs, and why (also in docs/nemo_rl.md):

* modules NeMo-RL imports that are not installed here and need Ray, a GPU, a download or a
  network service are stubbed (:data:`NEMO_RL_STUBBED`; only those missing), and the stubbed
  ``transformers`` reports a version (NeMo-RL's policy package asserts one at import);
* the CPU stands in for CUDA inside the body: ``Tensor.cuda`` and ``BatchedDataDict.to("cuda")``
  leave tensors where they are (restored afterwards);
* the worker object: ``MegatronPolicyWorker`` imports Megatron-Core names newer than the 0.19.2
  installed here (``FullyShardedDataParallelV1``), so its method bodies are replayed around
  NeMo-RL's functions (:func:`_train_body`, :func:`_logprob_body`), with the patched lines
  (``num_real_rows``, ``drop_placeholder_rows``) as the patch writes them;
* the tiny GPT's attention core is the project's reference THD attention (Transformer Engine needs
  CUDA), so NeMo-RL's THD packing runs as on a GPU.

Without ``NEMO_RL_DIR`` these tests are skipped (the pure parts are in
``tests/unit/test_nemo_rl_plan.py``).
"""

import contextlib
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_dynbatch.cpu.core_shim import apply_cpu_shim

apply_cpu_shim()

from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks  # noqa: E402
from tests._support import patched_copy  # noqa: E402

pytestmark = pytest.mark.nemo_rl

REPO = pathlib.Path(__file__).resolve().parents[2]
NEMO_RL_DIR = os.environ.get("NEMO_RL_DIR")
REL_TOL = 1e-5
BODY_TIMEOUT_S = 600
SEED = 11
VOCAB = 128
#: What NeMo-RL's dependencies pad each sample to (``policy.make_sequence_length_divisible_by``).
PAD_MULTIPLE = 4
#: Modules NeMo-RL imports that need Ray, a GPU, a download or a network service; stubbed only
#: when not installed.
NEMO_RL_STUBBED = (
    "ray",  # the cluster and worker groups
    "transformers",  # Hugging Face models and tokenizers (downloads)
    "requests",  # downloads (multimodal inputs)
    "zmq",  # IPC weight refit between GPU workers
    "pynvml",  # the NVIDIA driver
    "uvicorn",  # vLLM's HTTP server
    "fastapi",  # vLLM's HTTP server
    "mlflow",  # experiment trackers (network)
    "swanlab",
    "wandb",
    "prometheus_client",  # the metrics server
    "hydra",  # the DTensor (FSDP) path's model classes, loaded from Hugging Face
)
#: Megatron-Bridge (Hugging Face checkpoint conversion, Transformer Engine).
NEMO_RL_STUBBED_PREFIXES = ("megatron.bridge",)
#: A version below NeMo-RL's assert in ``nemo_rl/models/policy/__init__.py`` for the stub.
STUB_TRANSFORMERS_VERSION = "5.0.0"
#: The files the patches touch.
PATCHED_FILES = (
    "nemo_rl/models/policy/__init__.py",
    "nemo_rl/models/policy/lm_policy.py",
    "nemo_rl/models/policy/workers/megatron_policy_worker.py",
    "nemo_rl/models/megatron/train.py",
)

needs_nemo_rl = pytest.mark.skipif(not NEMO_RL_DIR, reason="NEMO_RL_DIR is not set")


@pytest.fixture(scope="module")
def patched_nemo_rl(tmp_path_factory):
    """A copy of NEMO_RL_DIR's ``nemo_rl`` package with the patches applied (the stock tree
    untouched)."""
    return patched_copy(NEMO_RL_DIR, "nemo_rl", tmp_path_factory.mktemp("nemo_rl_patched"))


# -- running NeMo-RL's code on a rank -----------------------------------------------------------

_ROOTS = set()


def _import_nemo_rl(root):
    """Stub what NeMo-RL needs and cannot have here; put ``root`` first on ``sys.path``."""
    from megatron_dynbatch.tools.testing.host_stubs import install_stubs, unstub

    # NeMo-RL's configs are pydantic models: the real pydantic, even where SkyRL's cases ran on
    # this pool worker before and replaced it with a stand-in.
    unstub(("pydantic",))
    stubbed = install_stubs(NEMO_RL_STUBBED, prefixes=NEMO_RL_STUBBED_PREFIXES)
    import transformers

    if not hasattr(transformers, "__file__"):  # the stub, not an installed transformers
        transformers.__version__ = STUB_TRANSFORMERS_VERSION
    for name in [n for n in sys.modules if n == "nemo_rl" or n.startswith("nemo_rl.")]:
        del sys.modules[name]
    sys.path[:] = [p for p in sys.path if p not in _ROOTS]
    _ROOTS.add(root)
    sys.path.insert(0, root)
    return stubbed


@contextlib.contextmanager
def _cuda_on_cpu():
    """NeMo-RL moves batches with ``.cuda()`` / ``.to("cuda")``; on CPU ranks they stay home."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    tensor_cuda, batch_to = torch.Tensor.cuda, BatchedDataDict.to

    def to(self, device):
        return self if str(device).startswith("cuda") else batch_to(self, device)

    torch.Tensor.cuda = lambda self, *a, **k: self
    BatchedDataDict.to = to
    try:
        yield
    finally:
        torch.Tensor.cuda, BatchedDataDict.to = tensor_cuda, batch_to


def _samples(num, seed=SEED, long_every=0):
    """Token ids and a loss mask per sample; every ``long_every``-th sample (when > 0) is long."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        longest = 30 if long_every and i % long_every == 0 else 14
        n = int(torch.randint(4, longest, (1,), generator=gen))
        tokens = torch.randint(1, VOCAB, (n,), generator=gen)
        mask = (torch.rand(n, generator=gen) > 0.3).to(torch.float32)
        mask[0] = 0  # the first token is the prompt
        mask[-1] = 1
        out.append((tokens, mask))
    return out


def _batch(samples):
    """The driver's batch: right-padded ``input_ids``, ``input_lengths``, ``token_mask``,
    ``sample_mask`` (NeMo-RL's SFT data spec)."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    width = max(t.numel() for t, _ in samples)
    n = len(samples)
    ids = torch.zeros((n, width), dtype=torch.int64)
    mask = torch.zeros((n, width), dtype=torch.float32)
    for i, (t, m) in enumerate(samples):
        ids[i, : t.numel()] = t
        mask[i, : t.numel()] = m
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.tensor([t.numel() for t, _ in samples], dtype=torch.int32),
        token_mask=mask,
        sample_mask=torch.ones(n, dtype=torch.float32),
    )


def _policy_cfg(pp, vpp, *, budget, logprob_budget, enabled=True):
    """The part of NeMo-RL's ``PolicyConfig`` these code paths (``Policy.__init__`` included)
    read."""
    return {
        "model_name": "tiny",
        "precision": "bfloat16",
        "max_total_sequence_length": 64,
        "make_sequence_length_divisible_by": PAD_MULTIPLE,
        "dynamic_batching": {"enabled": False},
        "sequence_packing": {
            "enabled": True,
            "train_mb_tokens": budget,
            "logprob_mb_tokens": logprob_budget,
            "algorithm": "modified_first_fit_decreasing",
        },
        "logprob_chunk_size": None,
        "megatron_cfg": {
            "enabled": True,
            "tensor_model_parallel_size": 1,
            "sequence_parallel": False,
            "pipeline_model_parallel_size": pp,
            "virtual_pipeline_model_parallel_size": vpp,
            "context_parallel_size": 1,
            "dynbatch": {"enabled": enabled},
        },
    }


#: A small model's Hugging Face config, as ``get_default_hf_config`` would read it (a download).
TINY_HF_CONFIG = dict(
    num_hidden_layers=4,
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=768,
    hidden_act="silu",
    vocab_size=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


class _WorkerGroupStarted(Exception):
    """Raised by the stand-in worker group: a Ray worker group would have started here."""


def _policy(cfg, dp, *, start_workers=True):
    """NeMo-RL's ``Policy`` built by its real (patched) ``__init__`` on ``cfg``, at ``dp`` DP
    ranks. Stubbed, because a CPU test cannot start them: the Ray cluster (``world_size()``), the
    worker builder, the pre-init queue and the worker group (Ray actors on GPUs), and
    ``get_default_hf_config`` (a Hugging Face download: a tiny model's config instead).
    ``start_workers=False``: the worker group raises :class:`_WorkerGroupStarted` when created,
    so a test sees whether a check ran before any worker would have started."""
    import types

    from nemo_rl.models.policy import lm_policy
    from nemo_rl.utils import flops_tracker

    def worker_group(*args, **kwargs):
        if not start_workers:
            raise _WorkerGroupStarted()
        return types.SimpleNamespace(args=args, kwargs=kwargs, shutdown=lambda **_: True)

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # NeMo-RL's Megatron check
    lm_policy.RayWorkerGroup = worker_group
    lm_policy.RayWorkerBuilder = lambda *args, **kwargs: None
    lm_policy.RayQueue = lambda *args, **kwargs: None
    # A model type NeMo-RL's FLOPs tracker does not know: it reports it and runs without one.
    hf_class = type("TinyConfig", (types.SimpleNamespace,), {"model_type": "tiny"})
    hf_config = lambda name: hf_class(**TINY_HF_CONFIG)  # noqa: E731
    flops_tracker.get_default_hf_config = hf_config
    lm_policy.get_default_hf_config = hf_config
    pp = cfg["megatron_cfg"]["pipeline_model_parallel_size"]
    cluster = types.SimpleNamespace(
        world_size=lambda: dp * pp, _sorted_bundle_indices=None, num_gpus_per_node=dp * pp
    )
    return lm_policy.Policy(cluster, cfg, tokenizer=None)


def _model():
    """The tiny GPT on this rank's stages in NeMo-RL's regime: per-token loss, DDP summing."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from megatron_dynbatch.mcore.thd_attention import with_thd_reference_attention
    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        make_schedule_config_safe,
        tiny_layer_spec,
        tiny_transformer_config,
        wrap_in_ddp,
    )

    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    config = tiny_transformer_config(
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        calculate_per_token_loss=True,  # NeMo-RL's setup sets it
    )
    make_schedule_config_safe(config)
    spec = with_thd_reference_attention(lambda c, vp_stage=None: tiny_layer_spec())(None)
    chunks = wrap_in_ddp(build_tiny_gpt(config, seed=SEED, layer_spec=spec))
    config.finalize_model_grads_func = finalize_model_grads
    return chunks


def _forward_backward(chunks, iterator, count, mbs, seq, post, **kwargs):
    from nemo_rl.models.megatron.train import megatron_forward_backward

    return megatron_forward_backward(
        model=chunks if len(chunks) > 1 else chunks[0],
        data_iterator=iterator,
        num_microbatches=count,
        seq_length=seq,
        mbs=mbs,
        post_processing_fn=post,
        **kwargs,
    )


def _train_body(cfg, shard, gbs, chunks):
    """``MegatronPolicyWorker.train`` on this rank's shard, without the optimizer step: the
    sum of every global batch's gradients (each normalised by its own valid tokens)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.utils import StragglerDetector
    from nemo_rl.algorithms.loss.loss_functions import NLLLossFn
    from nemo_rl.models.megatron.data import get_microbatch_iterator, process_global_batch
    from nemo_rl.models.megatron.train import LossPostProcessor

    from megatron_dynbatch.integrations.nemo_rl.shard import PLACEHOLDER_ROWS
    from megatron_dynbatch.tools.testing.tiny_gpt import named_global_grads

    dp_group = ps.get_data_parallel_group()
    dp = ps.get_data_parallel_world_size()
    total = torch.tensor(shard.size - len(getattr(shard, PLACEHOLDER_ROWS, ())))  # patch 0003
    dist.all_reduce(total, group=dp_group)
    num_global_batches = int(total) // gbs
    loss_fn = NLLLossFn()
    counts, valid, grads = [], [], {}
    for gb_idx in range(num_global_batches):
        # The worker zeroes the grad buffer per global batch (DDP all-reduces the buffer at the
        # end of each pass, so a second pass over a filled buffer would reduce it twice).
        for chunk in chunks:
            chunk.zero_grad_buffer()
        gb = process_global_batch(
            shard, loss_fn=loss_fn, dp_group=dp_group, batch_idx=gb_idx, batch_size=gbs // dp
        )
        valid.append((float(gb["global_valid_seqs"]), float(gb["global_valid_toks"])))
        iterator, count, mbs, _, padded = get_microbatch_iterator(
            gb["batch"], cfg, 1, straggler_timer=StragglerDetector()
        )
        counts.append(int(count))
        post = LossPostProcessor(loss_fn=loss_fn, cfg=cfg, num_microbatches=count)
        _forward_backward(
            chunks,
            iterator,
            count,
            mbs,
            padded,
            post,
            global_valid_seqs=gb["global_valid_seqs"],
            global_valid_toks=gb["global_valid_toks"],
            straggler_timer=StragglerDetector(),
        )
        for name, grad in named_global_grads(chunks).items():
            grads[name] = grads.get(name, 0) + grad
    return counts, valid, grads


def _logprob_body(cfg, shard, chunks):
    """``MegatronPolicyWorker.get_logprobs`` on this rank's shard: every row's log-probs (the
    first token 0), placeholder rows dropped as patch 0003 does, on every stage."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.utils import StragglerDetector
    from nemo_rl.models.megatron.data import get_microbatch_iterator
    from nemo_rl.models.megatron.train import LogprobsPostProcessor

    from megatron_dynbatch.integrations.nemo_rl.shard import PLACEHOLDER_ROWS, drop_placeholder_rows

    iterator, count, mbs, seq_length, padded = get_microbatch_iterator(
        shard, cfg, 1, straggler_timer=StragglerDetector()
    )
    post = LogprobsPostProcessor(cfg=cfg)
    with torch.no_grad():
        outputs = _forward_backward(chunks, iterator, count, mbs, padded, post, forward_only=True)
    holder = [None]
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        rows = []
        for out in outputs:
            lp = out["logprobs"]
            rows.append(torch.nn.functional.pad(lp, (0, seq_length - lp.shape[1])))
        holder = [torch.cat(rows)]
    dist.broadcast_object_list(
        holder,
        src=ps.get_pipeline_model_parallel_last_rank(),
        group=ps.get_pipeline_model_parallel_group(),
    )
    logprobs = holder[0]
    if getattr(shard, PLACEHOLDER_ROWS, None):  # as patch 0003 writes it
        logprobs = drop_placeholder_rows(shard, logprobs)
    return logprobs, int(count)


def _nemo_rl_body(root, num, gbs, budget, long_every, enabled=True):
    """One rank: shard as NeMo-RL's driver, log-probs, then a training pass; ``enabled``:
    ``policy.megatron_cfg.dynbatch.enabled`` (off: NeMo-RL's own sequence packing; ``None``: an
    empty ``dynbatch:`` section)."""
    from megatron.core import parallel_state as ps

    stubbed = _import_nemo_rl(root)
    from nemo_rl.models.megatron import train as nemo_train

    from megatron_dynbatch.integrations.nemo_rl.shard import num_real_rows, placeholder_rows

    assert nemo_train.__file__.startswith(root), nemo_train.__file__
    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    cfg = _policy_cfg(pp, vpp, budget=budget, logprob_budget=2 * budget, enabled=enabled)
    if enabled is None:  # `dynbatch:` with nothing under it
        cfg["megatron_cfg"]["dynbatch"] = None
    policy = _policy(cfg, dp)
    chunks = _model()
    data = _batch(_samples(num, long_every=long_every))
    with _cuda_on_cpu():
        shards, order = policy._shard_for_logprob(data)
        logprobs, logprob_count = _logprob_body(cfg, shards[dp_rank], chunks)
        train_shards = policy._shard_for_train(data, gbs)
        counts, valid, grads = _train_body(cfg, train_shards[dp_rank], gbs, chunks)
    return {
        "stubbed": stubbed,
        "dp_rank": dp_rank,
        "logprobs": logprobs,
        "order": order,
        "logprob_count": logprob_count,
        "counts": counts,
        "valid": valid,
        "placeholder_rows": [len(placeholder_rows(s)) for s in train_shards],
        "real_rows": [num_real_rows(s) for s in train_shards],
        "grads": grads,
    }


def _reference_body(num, gbs, long_every):
    """Each sample alone through a single-process tiny GPT: NLL over its masked tokens, divided
    by its global batch's valid tokens (NeMo-RL's ``NLLLossFn`` with ``global_valid_toks``)."""
    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        logprobs_from_logits,
        named_global_grads,
        response_outputs,
        tiny_transformer_config,
    )

    samples = _samples(num, long_every=long_every)
    [model] = build_tiny_gpt(tiny_transformer_config(), seed=SEED)
    model.zero_grad()
    total = 0.0
    logprobs = []
    for start in range(0, num, gbs):
        group = samples[start : start + gbs]
        valid_toks = sum(float(m[1:].sum()) for _, m in group)
        for tokens, mask in group:
            # Token t is scored at position t - 1: the first token plays the prompt.
            logits = response_outputs(model, tokens[:1], tokens[1:])
            lp = logprobs_from_logits(logits.unsqueeze(0), tokens[1:].unsqueeze(0))[0]
            logprobs.append(torch.cat([torch.zeros(1), lp.detach()]))
            total = total - (lp * mask[1:]).sum() / valid_toks
    total.backward()
    return {"grads": named_global_grads([model]), "logprobs": logprobs, "samples": samples}


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _driver_body(root, per_rank, order):
    """The driver's gather: NeMo-RL's ``BatchedDataDict.from_batches`` over the DP ranks'
    results, then ``reorder_data`` with the order the patched ``_shard_for_logprob`` returned."""
    _import_nemo_rl(root)
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    gathered = BatchedDataDict.from_batches([{"logprobs": lp} for lp in per_rank])
    gathered.reorder_data(order)
    return gathered["logprobs"]


def _check(root, results, reference, num, gbs, layout):
    merged = {}
    for r in results:
        merged.update(r["grads"])  # every rank holds the DP-reduced gradients of its stage
    assert set(merged) == set(reference["grads"])
    worst = max(_rel(merged[k], ref) for k, ref in reference["grads"].items())
    assert worst <= REL_TOL, worst
    # The driver: one result per DP rank, concatenated, then NeMo-RL's reorder_data.
    per_rank = {}
    for r in results:
        per_rank.setdefault(r["dp_rank"], r)
    [gathered] = run_on_ranks(
        1,
        _driver_body,
        root,
        [per_rank[d]["logprobs"] for d in sorted(per_rank)],
        results[0]["order"],
        layout=Layout(),
        timeout_s=BODY_TIMEOUT_S,
    )
    assert gathered.shape[0] == num
    worst_lp = 0.0
    for i, want in enumerate(reference["logprobs"]):
        got = gathered[i, : want.numel()]
        worst_lp = max(worst_lp, float((got - want).abs().max()))
    assert worst_lp <= 1e-5, worst_lp
    # Equal micro-batch counts on every rank, aligned to the interleaving group.
    for key in ("logprob_count", "counts"):
        assert len({str(r[key]) for r in results}) == 1, [r[key] for r in results]
    counts = results[0]["counts"] + [results[0]["logprob_count"]]
    if layout.vpp:
        assert all(c % layout.pp == 0 for c in counts), counts
    # Placeholders are in no denominator: NeMo-RL's own valid counts equal the real ones.
    samples = reference["samples"]
    for g, (seqs, toks) in enumerate(results[0]["valid"]):
        group = samples[g * gbs : (g + 1) * gbs]
        assert seqs == len(group)
        assert toks == sum(float(m[1:].sum()) for _, m in group)
    print(
        f"\n[nemo_rl {layout} dp={len(per_rank)}] grad rel diff max={worst:.2e} log-prob abs "
        f"diff max={worst_lp:.2e} microbatches train={results[0]['counts']} "
        f"logprob={results[0]['logprob_count']} placeholder rows per rank="
        f"{results[0]['placeholder_rows']} stubbed={results[0]['stubbed']}"
    )
    return results[0]["real_rows"]


#: (world, layout, samples, global batch size, budget, every n-th sample long)
CASES = [
    pytest.param(2, Layout(pp=2), 8, 4, 48, 3, id="pp2-dp1"),
    pytest.param(4, Layout(pp=2), 8, 4, 48, 3, id="pp2-dp2"),
    pytest.param(2, Layout(pp=2, vpp=2), 6, 6, 48, 2, id="pp2-vpp2-dp1"),
    # Three samples over two ranks at an interleaving group of 2: a rank with fewer real
    # micro-batches than the count runs placeholder micro-batches after them.
    pytest.param(4, Layout(pp=2, vpp=2), 3, 3, 48, 2, id="pp2-vpp2-dp2-placeholders"),
    # One sample per global batch at dp 2: in every global batch one rank holds placeholders only.
    pytest.param(4, Layout(pp=2), 3, 1, 48, 0, id="pp2-dp2-placeholder-rank"),
]


@needs_nemo_rl
@pytest.mark.parametrize("world, layout, num, gbs, budget, long_every", CASES)
def test_nemo_rl_matches_per_sample_reference(
    patched_nemo_rl, world, layout, num, gbs, budget, long_every
):
    results = run_on_ranks(
        world,
        _nemo_rl_body,
        patched_nemo_rl,
        num,
        gbs,
        budget,
        long_every,
        layout=layout,
        timeout_s=BODY_TIMEOUT_S,
    )
    [reference] = run_on_ranks(1, _reference_body, num, gbs, long_every, layout=Layout())
    real_rows = _check(patched_nemo_rl, results, reference, num, gbs, layout)
    dp = world // layout.pp
    if gbs < dp * max(results[0]["counts"]):
        # Too few samples for every rank to fill the count: placeholder rows must exist.
        assert sum(results[0]["placeholder_rows"]) > 0, results[0]["placeholder_rows"]
    if gbs < dp:
        # Fewer samples per global batch than DP ranks: a rank runs placeholders only.
        assert 0 in real_rows, real_rows


def _moe_body(root, num, gbs, budget, long_every):
    """NeMo-RL's training pass on a tiny MoE (4 experts, top-2, aux loss and z-loss): the tokens
    each router's statistics are handed on this rank, against its shard's real tokens."""
    import dataclasses

    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    from megatron_dynbatch.integrations.nemo_rl.shard import placeholder_rows
    from megatron_dynbatch.mcore.thd_attention import with_thd_reference_attention
    from megatron_dynbatch.tools.testing.tiny_gpt import (
        build_tiny_gpt,
        make_schedule_config_safe,
        tiny_layer_spec,
        tiny_transformer_config,
        wrap_in_ddp,
    )
    from tests._support import TINY_MOE as MOE
    from tests._support import RouterTokens

    _import_nemo_rl(root)

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    dp, rank = (
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_data_parallel_rank(),
    )
    cfg = _policy_cfg(pp, 1, budget=budget, logprob_budget=2 * budget)
    policy = _policy(cfg, dp)
    config = tiny_transformer_config(
        pipeline_model_parallel_size=pp, calculate_per_token_loss=True, **MOE
    )
    config.moe_router_load_balancing_type = "aux_loss"
    config.moe_aux_loss_coeff, config.moe_z_loss_coeff = 1e-2, 1e-3
    config = dataclasses.replace(config, moe_token_dispatcher_type="alltoall")
    make_schedule_config_safe(config)
    spec = with_thd_reference_attention(
        lambda c, vp_stage=None: tiny_layer_spec(MOE["num_moe_experts"])
    )(None)
    chunks = wrap_in_ddp(build_tiny_gpt(config, seed=SEED, layer_spec=spec))
    config.finalize_model_grads_func = finalize_model_grads
    data = _batch(_samples(num, long_every=long_every))
    routers = RouterTokens()
    with _cuda_on_cpu(), routers.installed():
        shards = policy._shard_for_train(data, gbs)
        routers.active = True
        _, _, grads = _train_body(cfg, shards[rank], gbs, chunks)
        routers.active = False
    shard = shards[rank]
    skipped = set(placeholder_rows(shard))
    real = sum(int(n) for i, n in enumerate(shard["input_lengths"].tolist()) if i not in skipped)
    return {
        "routed": dict(routers.per_layer),
        "real": real,
        "placeholder_rows": len(skipped),
        "finite": all(bool(torch.isfinite(g).all()) for g in grads.values()),
    }


@needs_nemo_rl
def test_moe_routers_count_no_placeholder_row(patched_nemo_rl):
    """A probe: one sample per global batch at dp 2, so rank 1 holds placeholder rows only; each
    of its router layers counted 12 tokens (NeMo-RL passes no padding mask). Patch 0005 marks
    them: rank 1 routes nothing into any statistic, with finite gradients (its load-balancing
    losses are off for a micro-batch of padding); rank 0 counts its own tokens as stock NeMo-RL
    does (its real ones plus NeMo-RL's packing pads)."""
    first, second = run_on_ranks(
        2, _moe_body, patched_nemo_rl, 3, 1, 48, 0, layout=Layout(), timeout_s=BODY_TIMEOUT_S
    )
    assert second["real"] == 0 and second["placeholder_rows"] > 0, second
    assert second["routed"] and set(second["routed"].values()) == {0}, second
    assert first["placeholder_rows"] == 0 and first["real"] > 0, first
    assert all(count >= first["real"] for count in first["routed"].values()), first
    assert first["finite"] and second["finite"]


# -- the switch off: the patched tree is the stock one ------------------------------------------


@needs_nemo_rl
def test_switch_off_runs_bitwise_as_stock(patched_nemo_rl):
    """The same step with the switch off on the patched tree (an empty ``dynbatch:`` section, YAML
    ``None``, through the patched ``Policy.__init__`` and the worker's patched lines) and on the
    pristine one (NeMo-RL's own sequence packing at pp 2, dp 2): identical log-probs, gradients
    and counts."""
    args = (8, 4, 48, 3)
    patched = run_on_ranks(
        4,
        _nemo_rl_body,
        patched_nemo_rl,
        *args,
        enabled=None,
        layout=Layout(pp=2),
        timeout_s=BODY_TIMEOUT_S,
    )
    stock = run_on_ranks(
        4,
        _nemo_rl_body,
        NEMO_RL_DIR,
        *args,
        enabled=False,
        layout=Layout(pp=2),
        timeout_s=BODY_TIMEOUT_S,
    )
    for mine, theirs in zip(patched, stock, strict=True):
        assert mine["placeholder_rows"] == [0, 0]
        assert torch.equal(mine["logprobs"], theirs["logprobs"])
        assert mine["order"] == theirs["order"] and mine["counts"] == theirs["counts"]
        assert mine["grads"].keys() == theirs["grads"].keys()
        assert all(torch.equal(mine["grads"][k], theirs["grads"][k]) for k in mine["grads"])


def _stock_shards_body(root, enabled_key):
    """NeMo-RL's ``_shard_for_train`` / ``_shard_for_logprob`` with sequence packing and the
    switch off (``enabled_key``: ``False``, or ``None`` for no ``dynbatch`` section at all)."""
    _import_nemo_rl(root)
    cfg = _policy_cfg(2, 1, budget=48, logprob_budget=96, enabled=False)
    if enabled_key is None:
        del cfg["megatron_cfg"]["dynbatch"]
    elif enabled_key == "empty":  # `dynbatch:` with nothing under it (YAML None)
        cfg["megatron_cfg"]["dynbatch"] = None
    policy = _policy({**cfg}, 2)
    data = _batch(_samples(12, long_every=3))
    train = policy._shard_for_train(data, 6)
    logprob, order = policy._shard_for_logprob(data)

    def plain(shards):
        return [
            (
                {k: v.tolist() for k, v in s.items()},
                s.micro_batch_indices,
                s.micro_batch_lengths,
                s.elem_counts_per_gb,
            )
            for s in shards
        ]

    return {"train": plain(train), "logprob": plain(logprob), "order": list(order)}


@needs_nemo_rl
@pytest.mark.parametrize("enabled_key", [False, "empty"], ids=["enabled-false", "empty-section"])
def test_switch_off_shards_as_stock(patched_nemo_rl, enabled_key):
    [patched] = run_on_ranks(
        1,
        _stock_shards_body,
        patched_nemo_rl,
        enabled_key,
        layout=Layout(),
        timeout_s=BODY_TIMEOUT_S,
    )
    [stock] = run_on_ranks(
        1, _stock_shards_body, NEMO_RL_DIR, None, layout=Layout(), timeout_s=BODY_TIMEOUT_S
    )
    assert patched == stock


#: Bad ``policy`` configs (a change to :func:`_policy_cfg` at pp 2) and what the refusal names.
BAD_CONFIGS = {
    # NeMo-RL's own assert (pp > 1 with its dynamic batching) fires after the worker group starts.
    "dynamic-batching-at-pp2": (
        {"dynamic_batching": {"enabled": True, "train_mb_tokens": 48}},
        "policy.dynamic_batching.enabled=false",
    ),
    "planner-typo": ({"planner": "dynbach"}, "policy.megatron_cfg.dynbatch.planner='dynbach'"),
    "budget-0": ({"train_mb_tokens": 0}, "policy.sequence_packing.train_mb_tokens=0"),
    "logprob-budget-negative": (
        {"logprob_mb_tokens": -5},
        "policy.sequence_packing.logprob_mb_tokens=-5",
    ),
    "switch-not-boolean": ({"enabled": "yes"}, "policy.megatron_cfg.dynbatch.enabled='yes'"),
    "unknown-key": ({"max_memory": 70}, "policy.megatron_cfg.dynbatch has unknown key"),
    "memory-negative": ({"max_memory_gib": -1}, "policy.megatron_cfg.dynbatch.max_memory_gib=-1"),
    "memory-zero": ({"max_memory_gib": 0}, "policy.megatron_cfg.dynbatch.max_memory_gib=0"),
    "memory-nan": ({"max_memory_gib": float("nan")}, "max_memory_gib=nan"),
    "memory-inf": ({"max_memory_gib": float("inf")}, "max_memory_gib=inf"),
    "memory-too-small": (
        {"max_memory_gib": 0.001},
        "policy.megatron_cfg.dynbatch.max_memory_gib=0.001 is too small",
    ),
    "overhead-negative": (
        {"cost_microbatch_overhead": -1},
        "policy.megatron_cfg.dynbatch.cost_microbatch_overhead=-1 must be a finite number >= 0",
    ),
    "planner-padded-only": (
        {"planner": "fixed"},
        "policy.megatron_cfg.dynbatch.planner='fixed' plans padded rows only",
    ),
    "overhead-text": (
        {"cost_microbatch_overhead": "lots"},
        "policy.megatron_cfg.dynbatch.cost_microbatch_overhead='lots' must be a finite number",
    ),
}


def _bad_cfg(change):
    cfg = _policy_cfg(2, 1, budget=48, logprob_budget=96)
    section = cfg["megatron_cfg"]["dynbatch"]
    for key, value in change.items():
        if key in ("train_mb_tokens", "logprob_mb_tokens"):
            cfg["sequence_packing"][key] = value
        elif key == "dynamic_batching":
            cfg[key] = value
        else:
            section[key] = value
    return cfg


def _config_time_body(root):
    """Every bad config through the patched ``Policy.__init__``: what it raised, and whether the
    worker group would have started first."""
    _import_nemo_rl(root)
    out = {}
    for name, (change, _) in BAD_CONFIGS.items():
        try:
            _policy(_bad_cfg(change), 2, start_workers=False)
        except _WorkerGroupStarted:
            out[name] = ("workers started", "")
        except Exception as error:  # noqa: BLE001 - the test compares the type
            out[name] = (type(error).__name__, str(error))
        else:
            out[name] = ("not refused", "")
    return out


@needs_nemo_rl
def test_bad_configs_are_refused_by_the_patched_policy_before_any_worker(patched_nemo_rl):
    """Each bad ``policy`` value, through NeMo-RL's real (patched) ``Policy.__init__``, is refused
    with a ``DynBatchValueError`` naming NeMo-RL's key, before the Ray worker group is created
    (its stand-in raises if it is), and before NeMo-RL's own pp > 1 assert."""
    [out] = run_on_ranks(
        1, _config_time_body, patched_nemo_rl, layout=Layout(), timeout_s=BODY_TIMEOUT_S
    )
    for name, (_, words) in BAD_CONFIGS.items():
        kind, message = out[name]
        assert kind == "DynBatchValueError", (name, kind, message)
        assert words in message, (name, message)
        # Our words only: no internal "(in NeMo-RL's options: x -> field)" mapping.
        assert " -> " not in message and "options:" not in message, (name, message)
    assert "raise policy.megatron_cfg.dynbatch.max_memory_gib to at least" in (
        out["memory-too-small"][1]
    )


def _memory_body(root):
    """The smallest budget the too-small refusal names: the patched ``Policy`` accepts it and plans
    every micro-batch within it; without a budget the same samples pack fuller rows."""
    import re

    from megatron_dynbatch.planning.memory import GIB, predicted_step_peaks

    _import_nemo_rl(root)
    cfg = _policy_cfg(2, 1, budget=48, logprob_budget=96)
    cfg["max_total_sequence_length"] = 32
    cfg["megatron_cfg"]["dynbatch"]["max_memory_gib"] = 0.001
    try:
        _policy(cfg, 2)
    except Exception as error:  # noqa: BLE001
        message = str(error)
    smallest = float(re.search(r"to at least ([0-9.]+)", message).group(1))
    cfg["megatron_cfg"]["dynbatch"]["max_memory_gib"] = smallest
    policy = _policy(cfg, 2)
    limit = policy.dynbatch.memory
    data = _batch(_samples(12, long_every=3))
    rows = [list(s.micro_batch_lengths) for s in policy._shard_for_train(data, 6)]
    del cfg["megatron_cfg"]["dynbatch"]["max_memory_gib"]
    free = [list(s.micro_batch_lengths) for s in _policy(cfg, 2)._shard_for_train(data, 6)]
    peaks = []
    for g in range(len(rows[0])):
        shapes = [[(1, row) for row in rank[g]] for rank in rows]
        peaks.append(max(t.total for t in predicted_step_peaks(limit.model, shapes)))
    return {
        "smallest": smallest,
        "budget": limit.budget_bytes,
        "gib": limit.budget_bytes / GIB,
        "peaks": peaks,
        "rows": rows,
        "free": free,
    }


@needs_nemo_rl
def test_memory_budget_in_nemo_rls_key_is_planned_per_stage(patched_nemo_rl):
    [out] = run_on_ranks(
        1, _memory_body, patched_nemo_rl, layout=Layout(), timeout_s=BODY_TIMEOUT_S
    )
    assert out["peaks"] and max(out["peaks"]) <= out["budget"], out
    longest = max(row for rank in out["rows"] for gb in rank for row in gb)
    longest_free = max(row for rank in out["free"] for gb in rank for row in gb)
    # The budget binds: rows stay shorter than the token budget lets them be.
    assert longest < longest_free <= 48, (longest, longest_free)
    print(f"\n[nemo_rl memory] smallest budget {out['smallest']} GiB, peaks {out['peaks']}")


def _stock_refusal_body(root, section):
    """NeMo-RL's own refusals through ``Policy.__init__`` with the switch off (``section``:
    ``"absent"``, ``"empty"`` (YAML ``None``) or ``"off"`` (``enabled: false``)): what each
    raised."""
    _import_nemo_rl(root)
    out = {}
    cases = {
        # pp 2 with NeMo-RL's dynamic batching: its assert, after the worker group.
        "dynamic-batching-at-pp2": (2, {"enabled": True, "sequence_length_round": 64}, False),
        # its dynamic batching and sequence packing together: its assert.
        "dynamic-batching-and-packing": (1, {"enabled": True, "sequence_length_round": 64}, True),
    }
    for name, (pp, dynamic, packing) in cases.items():
        cfg = _policy_cfg(pp, 1, budget=48, logprob_budget=96, enabled=False)
        cfg["dynamic_batching"] = dynamic
        cfg["sequence_packing"]["enabled"] = packing
        if section == "absent":
            del cfg["megatron_cfg"]["dynbatch"]
        elif section == "empty":
            cfg["megatron_cfg"]["dynbatch"] = None
        try:
            _policy(cfg, 2)
        except Exception as error:  # noqa: BLE001 - the test compares type and message
            out[name] = (type(error).__name__, str(error))
        else:
            out[name] = ("not refused", "")
    return out


@needs_nemo_rl
@pytest.mark.parametrize("section", ["empty", "off"])
def test_switch_off_refuses_as_stock_where_nemo_rl_raises(patched_nemo_rl, section):
    """The exact way back, bad cases included: with the switch off the patched ``Policy.__init__``
    stops where the pristine one stops, with NeMo-RL's own error."""
    [patched] = run_on_ranks(
        1, _stock_refusal_body, patched_nemo_rl, section, layout=Layout(), timeout_s=BODY_TIMEOUT_S
    )
    [stock] = run_on_ranks(
        1, _stock_refusal_body, NEMO_RL_DIR, "absent", layout=Layout(), timeout_s=BODY_TIMEOUT_S
    )
    assert all(kind == "AssertionError" for kind, _ in stock.values()), stock
    assert patched == stock


def _spy_body(root):
    """A planner registered by name and set as ``policy.megatron_cfg.dynbatch.planner``: NeMo-RL's
    planning calls it (training and log-prob shards), with the per-micro-batch overhead set beside
    it (``cost_microbatch_overhead``) in its cost model."""
    from megatron_dynbatch.planning import register_planner
    from megatron_dynbatch.planning.planner import plan_samples

    _import_nemo_rl(root)
    calls = []

    def spy(samples, config):
        calls.append((len(samples), config.planner, config.cost.microbatch_overhead))
        return plan_samples(samples, config)

    register_planner("hostcfg-spy", spy, replace=True)
    cfg = _policy_cfg(2, 1, budget=48, logprob_budget=96)
    cfg["megatron_cfg"]["dynbatch"]["planner"] = "hostcfg-spy"
    cfg["megatron_cfg"]["dynbatch"]["cost_microbatch_overhead"] = 330
    policy = _policy(cfg, 2)
    data = _batch(_samples(12, long_every=3))
    policy._shard_for_train(data, 6)
    policy._shard_for_logprob(data)
    return calls


@needs_nemo_rl
def test_the_planner_key_names_the_planner_nemo_rl_plans_with(patched_nemo_rl):
    [calls] = run_on_ranks(1, _spy_body, patched_nemo_rl, layout=Layout(), timeout_s=BODY_TIMEOUT_S)
    # Two global batches of 6 for training, then the whole batch for log-probs; each told the
    # overhead the config gives.
    spy = ("hostcfg-spy", 330.0)
    assert calls == [(6, *spy), (6, *spy), (12, *spy)], calls


# -- NeMo-RL's own CPU tests on the patched tree ------------------------------------------------

#: NeMo-RL's unit tests of what the patched shards feed: BatchedDataDict sharding (and its
#: sequence-packing / dynamic-batching sharding) and the packing algorithms.
OWN_TESTS = (
    "tests/unit/distributed/test_batched_data_dict.py",
    "tests/unit/data/packing/test_algorithms.py",
)


def _run_own_tests(tree, out):
    """Run NeMo-RL's ``OWN_TESTS`` against ``tree``'s ``nemo_rl`` (stubs via a conftest)."""
    out.mkdir()
    for test in OWN_TESTS:
        target = out / test
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(pathlib.Path(NEMO_RL_DIR) / test, target)
    (out / "conftest.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        f"sys.path.insert(0, {tree!r})\n"
        "from megatron_dynbatch.tools.testing.host_stubs import install_stubs\n"
        f"install_stubs({NEMO_RL_STUBBED!r}, prefixes={NEMO_RL_STUBBED_PREFIXES!r})\n"
        "import transformers\n"
        "if not hasattr(transformers, '__file__'):\n"
        f"    transformers.__version__ = {STUB_TRANSFORMERS_VERSION!r}\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "--rootdir",
            str(out),
            *OWN_TESTS,
        ],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=BODY_TIMEOUT_S,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    summary = re.sub(r" in [0-9.]+s.*", "", summary)  # counts, not timings
    return result.returncode, summary, result.stdout + result.stderr


@needs_nemo_rl
def test_nemo_rl_own_sharding_and_packing_tests_pass_on_patched_tree(patched_nemo_rl, tmp_path):
    patched = _run_own_tests(patched_nemo_rl, tmp_path / "patched")
    stock = _run_own_tests(NEMO_RL_DIR, tmp_path / "stock")
    print(f"\n[nemo_rl own tests] patched: {patched[1]} | pristine: {stock[1]}")
    assert patched[0] == 0, patched[2][-4000:]
    assert patched[1] == stock[1]
