"""``megatron-dynbatch verify``: dynamic batching on real Megatron-Core against a per-sample reference.

It plans a step with the real planner, trains it through Megatron's schedule for the requested
layout (no pipelining, 1F1B or interleaved; DP over gloo on CPU, NCCL under torchrun on GPUs) with
a tiny GPT initialised identically on every layout, and compares with a single-process reference
that runs every sample alone in its own row with plain autograd:

* ``max_grad_rel_diff``: over parameters, the largest ``||g - g_ref|| / ||g_ref||`` (every rank's
  gradients are compared, so DP replicas that disagree fail too); ``max_grad_abs_diff`` the largest
  element-wise difference;
* ``max_logprob_abs_diff``: forward-only per-token log-probs, gathered back into sample order;
* the step loss against the reference loss.

The per-token loss is an RL-style ``cross_entropy * advantage`` with one advantage per sample, so a
declared per-sample field travels through materialization, placeholders and the pipeline.

One concern per module: :mod:`.spec` (the validated request and its deterministic data),
:mod:`.machine` (what this machine can finish, refused before any rank starts),
:mod:`.bodies` (what every rank runs, and the reference), :mod:`.compare` (the verdict),
:mod:`.launch` (gloo worker pool or an existing torchrun world), :mod:`.cli` (the command).
"""

from megatron_dynbatch.tools.verify.bodies import dynamic_body, reference_body
from megatron_dynbatch.tools.verify.compare import GRAD_REL_TOL, LOGPROB_ABS_TOL, compare
from megatron_dynbatch.tools.verify.launch import run_verify
from megatron_dynbatch.tools.verify.spec import (
    DEFAULT_MAX_TOKENS_PER_GPU,
    VerifySpec,
    build_spec,
)

__all__ = [
    "DEFAULT_MAX_TOKENS_PER_GPU",
    "GRAD_REL_TOL",
    "LOGPROB_ABS_TOL",
    "VerifySpec",
    "build_spec",
    "compare",
    "dynamic_body",
    "reference_body",
    "run_verify",
]
