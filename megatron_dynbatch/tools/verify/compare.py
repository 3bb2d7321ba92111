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


def _grad_diffs(dynamic: List[Dict[str, Any]], reference: Dict[str, Any]):
    """Largest relative (per parameter, by norm) and absolute gradient differences, over every
    rank and optimizer step."""
    max_rel, max_abs = 0.0, 0.0
    for step, ref_step in enumerate(reference["steps"]):
        ref_grads = ref_step["grads"]
        seen = set()
        for result in dynamic:
            for name, grad in result["steps"][step]["grads"].items():
                if name not in ref_grads:
                    raise AssertionError(f"parameter {name} has no reference gradient")
                seen.add(name)
                ref = ref_grads[name]
                max_abs = max(max_abs, float((grad - ref).abs().max()))
                max_rel = max(max_rel, float((grad - ref).norm() / ref.norm().clamp_min(1e-30)))
        missing = sorted(set(ref_grads) - seen)
        if missing:
            raise AssertionError(f"step {step}: no rank returned gradients for {missing}")
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
    num_steps = len(reference["steps"])
    assert all(len(r["steps"]) == num_steps for r in dynamic), "every rank ran every step"
    max_rel, max_abs = _grad_diffs(dynamic, reference)
    max_lp = _logprob_diff(spec, dynamic, reference["logprobs"])
    losses = []
    for step in range(num_steps):
        # Every DP rank's last stage logs its own share; other pipeline stages log none.
        sums = [r["steps"][step]["log_sums"] for r in dynamic]
        numerator = sum(s[0] for s in sums if s is not None)
        denominator = sum(s[1] for s in sums if s is not None)
        losses.append(
            float(finalize_loss(spec.loss, torch.tensor(numerator), torch.tensor(denominator)))
        )
    reference_losses = [step["loss"] for step in reference["steps"]]
    passed = (
        max_rel <= GRAD_REL_TOL
        and max_lp <= LOGPROB_ABS_TOL
        and all(
            math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6)
            for got, want in zip(losses, reference_losses, strict=True)
        )
        and len({r["fingerprint"] for r in dynamic}) == 1
    )
    first = dynamic[0]
    shapes = first["shapes"]
    return {
        "passed": passed,
        "max_grad_rel_diff": max_rel,
        "max_grad_abs_diff": max_abs,
        "max_logprob_abs_diff": max_lp,
        # One optimizer step (the default): its loss. Several (--rollouts-per-step): their mean,
        # each step's in step_losses; every one must match its reference.
        "loss": sum(losses) / num_steps,
        "reference_loss": sum(reference_losses) / num_steps,
        "num_steps": num_steps,
        "step_losses": losses,
        "reference_step_losses": reference_losses,
        "num_placeholders": first["num_placeholders"],
        "truncated_tokens": first["truncated_tokens"],
        # The first step's shape (the only one by default); every step's in step_shapes.
        "num_microbatches": shapes[0]["num_microbatches"],
        "seq_length": shapes[0]["seq_length"],
        "micro_batch_size": shapes[0]["micro_batch_size"],
        "step_shapes": shapes,
        **settings,
        "backend": ran["backend"],
        "train_seconds_max_rank": max(r["train_seconds"] for r in dynamic),
    }
