"""The verify verdict: every rank's gradients, the gathered log-probs and the loss vs the reference."""

from __future__ import annotations

import math
from typing import Any, Dict, List

from megatron_dynbatch.tools.verify.spec import VerifySpec

__all__ = ["GRAD_REL_TOL", "LOGPROB_ABS_TOL", "compare"]

#: Pass threshold on the relative gradient difference (fp32; summation order differs by layout).
GRAD_REL_TOL = 1e-5
#: Pass threshold on log-prob differences (fp32 log-softmax over the tiny model's vocabulary).
LOGPROB_ABS_TOL = 1e-5


def _grad_diffs(dynamic: List[Dict[str, Any]], ref_grads: Dict[str, Any]):
    """Largest relative (per parameter, by norm) and absolute gradient differences, all ranks."""
    seen = set()
    max_rel, max_abs = 0.0, 0.0
    for result in dynamic:
        for name, grad in result["grads"].items():
            if name not in ref_grads:
                raise AssertionError(f"parameter {name} has no reference gradient")
            seen.add(name)
            ref = ref_grads[name]
            max_abs = max(max_abs, float((grad - ref).abs().max()))
            max_rel = max(max_rel, float((grad - ref).norm() / ref.norm().clamp_min(1e-30)))
    missing = sorted(set(ref_grads) - seen)
    if missing:
        raise AssertionError(f"no rank returned gradients for {missing}")
    return max_rel, max_abs


def _logprob_diff(spec: VerifySpec, dynamic: List[Dict[str, Any]], reference_logprobs) -> float:
    [logprobs] = [r["logprobs"] for r in dynamic if r["logprobs"] is not None]
    if len(logprobs) != spec.num_samples:
        raise AssertionError(f"{len(logprobs)} log-prob tensors for {spec.num_samples} samples")
    worst = 0.0
    for index, (got, want) in enumerate(zip(logprobs, reference_logprobs, strict=True)):
        if got.shape != want.shape:
            raise AssertionError(
                f"sample {index}: log-probs {tuple(got.shape)} vs {tuple(want.shape)}"
            )
        if got.numel() > 1:  # the last position has no target
            worst = max(worst, float((got[:-1] - want[:-1]).abs().max()))
    return worst


def compare(
    spec: VerifySpec, dynamic: List[Dict[str, Any]], reference: Dict[str, Any]
) -> Dict[str, Any]:
    """Reduce the per-rank results and the reference to the verify report."""
    import torch

    from megatron_dynbatch.runtime import finalize_loss

    settings = spec.settings()
    # Internal invariant: the launcher initialised exactly the requested layout on every rank.
    ran = dynamic[0]["ran"]
    assert all(r["ran"] == ran for r in dynamic), [r["ran"] for r in dynamic]
    for key in ("dp_size", "pp_size", "vpp_size", "tp_size", "cp_size", "world_size"):
        assert ran[key] == settings[key], f"asked {key}={settings[key]}, ran {ran[key]}"
    ep_size = 1 if spec.moe is None else spec.moe.ep_size
    assert ran["ep_size"] == ep_size, f"asked ep_size={ep_size}, ran {ran['ep_size']}"
    max_rel, max_abs = _grad_diffs(dynamic, reference["grads"])
    max_lp = _logprob_diff(spec, dynamic, reference["logprobs"])
    # Every DP rank's last stage logs its own share; pipeline stages other than the last log none.
    numerator = sum(r["log_sums"][0] for r in dynamic if r["log_sums"] is not None)
    denominator = sum(r["log_sums"][1] for r in dynamic if r["log_sums"] is not None)
    loss = float(finalize_loss(spec.loss, torch.tensor(numerator), torch.tensor(denominator)))
    passed = (
        max_rel <= GRAD_REL_TOL
        and max_lp <= LOGPROB_ABS_TOL
        and math.isclose(loss, reference["loss"], rel_tol=1e-5, abs_tol=1e-6)
        and len({r["fingerprint"] for r in dynamic}) == 1
    )
    first = dynamic[0]
    return {
        "passed": passed,
        "max_grad_rel_diff": max_rel,
        "max_grad_abs_diff": max_abs,
        "max_logprob_abs_diff": max_lp,
        "loss": loss,
        "reference_loss": reference["loss"],
        "num_placeholders": first["num_placeholders"],
        "truncated_tokens": first["truncated_tokens"],
        "num_microbatches": first["num_microbatches"],
        "seq_length": first["seq_length"],
        "micro_batch_size": first["micro_batch_size"],
        **settings,
        "backend": ran["backend"],
        "train_seconds_max_rank": max(r["train_seconds"] for r in dynamic),
    }
