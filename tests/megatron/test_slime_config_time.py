"""slime's configuration time and its exact way back, patched by ``patches/slime``.

With ``SLIME_DIR`` (a slime checkout at the commit named in ``patches/slime/README.md``), in gloo
workers:

* slime's own ``parse_args`` steps (``_pre_parse_mode``, ``megatron_parse_args``: Megatron's parser
  with slime's arguments, then ``slime_validate_args``, which ``parse_args`` runs before any Ray
  actor or rollout; sglang's own parse is left out), on
  the patched tree: a bad ``--max-memory-gib`` (-1, 0, nan, inf), an unknown
  ``--dynamic-batch-planner``, and our options given while slime's own batching runs (without
  ``--use-dynamic-batch-size``, or with ``--use-slime-dynamic-batch-size``) are refused there, in
  slime's flag names; a good command line keeps ``--micro-batch-planner-path`` (the hook) only when
  ours runs. The pristine tree validates the same good command line.
* slime's ``compute_advantages_and_returns`` with REINFORCE++ on a batch with a fully masked sample:
  with the switch off, patched and pristine slime both stop on slime's assert, with the same
  message; with it on, the fully masked sample gets zero returns and every other sample exactly
  the returns pristine slime gives it on the batch without that sample.

Stubbed: the modules slime imports for serving and logging (as in ``test_slime_patched.py``;
``transformers`` too), and ``typing.override`` is provided on Python 3.11 for
``megatron.training``.
"""

import os
import sys

import pytest

from megatron_dynbatch.tools.testing.workers import Layout, run_on_ranks
from tests._support import SLIME_STUBBED, patched_copy, stock_copy

pytestmark = pytest.mark.slime

SLIME_DIR = os.environ.get("SLIME_DIR")
STUBBED = SLIME_STUBBED + ("transformers",)
#: A tiny GPT (Megatron's flags, as a slime launch script gives them).
MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "256", "--vocab-size", "128", "--seq-length", "4096",
    "--max-position-embeddings", "4096", "--position-embedding-type", "rope",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--rollout-batch-size", "4",
    "--max-tokens-per-gpu", "8192", "--num-rollout", "1",
]  # fmt: skip
ON = ["--use-dynamic-batch-size"]
WAY_BACK = ["--use-dynamic-batch-size", "--use-slime-dynamic-batch-size"]
#: name -> (extra argv, words the refusal must contain)
BAD = {
    "memory-negative": ([*ON, "--max-memory-gib", "-1"], "--max-memory-gib -1.0 must be"),
    "memory-zero": ([*ON, "--max-memory-gib", "0"], "--max-memory-gib 0.0 must be"),
    "memory-nan": ([*ON, "--max-memory-gib", "nan"], "--max-memory-gib nan must be"),
    "memory-inf": ([*ON, "--max-memory-gib", "inf"], "--max-memory-gib inf must be"),
    "planner-typo": ([*ON, "--dynamic-batch-planner", "dynbach"], "no planner named"),
    # slime packs its rows: the padded-row baseline is refused by slime's own parser, not at step 1.
    "planner-fixed": ([*ON, "--dynamic-batch-planner", "fixed"], "fixed plans padded rows only"),
    "overhead-negative": (
        [*ON, "--dynamic-batch-cost-microbatch-overhead", "-1"],
        "--dynamic-batch-cost-microbatch-overhead -1.0 must be a finite number >= 0",
    ),
    "overhead-without-switch": (
        ["--dynamic-batch-cost-microbatch-overhead", "330"],
        "--dynamic-batch-cost-microbatch-overhead 330.0 is read only",
    ),
    "memory-without-switch": (
        ["--max-memory-gib", "70"],
        "--max-memory-gib 70.0 is read only by megatron_dynbatch's dynamic batching, which is off "
        "without --use-dynamic-batch-size",
    ),
    "memory-with-way-back": (
        [*WAY_BACK, "--max-memory-gib", "70"],
        "off with --use-slime-dynamic-batch-size",
    ),
    "oversize-without-switch": (["--oversize-samples", "error"], "--oversize-samples error"),
    "planner-without-switch": (["--dynamic-batch-planner", "fixed"], "--dynamic-batch-planner"),
    "way-back-without-switch": (
        ["--use-slime-dynamic-batch-size"],
        "--use-slime-dynamic-batch-size is read only",
    ),
    # Probes: each passed slime's validation and was refused by the first schedule, after the
    # first rollout.
    "budgets-under-a-sample": (
        [*ON, "--tensor-model-parallel-size", "4", "--max-tokens-per-gpu", "2"]
        + ["--log-probs-max-tokens-per-gpu", "3"],
        "--max-tokens-per-gpu to at least 4. --log-probs-max-tokens-per-gpu=3 is smaller",
    ),
    "group-under-pipeline": (
        [*ON, "--num-layers", "4", "--pipeline-model-parallel-size", "2"]
        + ["--num-virtual-stages-per-pipeline-rank", "2"]
        + ["--microbatch-group-size-per-virtual-pipeline-stage", "1"],
        "microbatch_group_size_per_vp_stage is --microbatch-group-size-per-virtual-pipeline",
    ),
}
#: name -> (extra argv, whether the hook stays on)
GOOD = {
    "on": (ON, True),
    "on-told-overhead": ([*ON, "--dynamic-batch-cost-microbatch-overhead", "330"], True),
    "way-back": (WAY_BACK, False),
    "off": ([], False),
}

needs_slime = pytest.mark.skipif(not SLIME_DIR, reason="SLIME_DIR is not set")


@pytest.fixture(scope="module")
def stock_slime(tmp_path_factory):
    return stock_copy(SLIME_DIR, "slime", tmp_path_factory.mktemp("slime_stock"))


@pytest.fixture(scope="module")
def patched_slime(tmp_path_factory, stock_slime):
    return patched_copy(stock_slime, "slime", tmp_path_factory.mktemp("slime_patched"))


def _import_slime(slime_root):
    from megatron_dynbatch.cpu.core_shim import apply_cpu_shim
    from megatron_dynbatch.cpu.training_shim import provide_typing_override
    from megatron_dynbatch.tools.testing.host_stubs import install_stubs

    apply_cpu_shim()
    provide_typing_override()
    install_stubs(STUBBED)
    for name in [n for n in sys.modules if n == "slime" or n.startswith("slime.")]:
        del sys.modules[name]
    sys.path.insert(0, slime_root)


def _validate_body(slime_root, cases):
    """slime's parse and ``slime_validate_args`` of each case's command line: the error it raised
    (type, message), or what it left in ``micro_batch_planner_path``."""
    _import_slime(slime_root)
    from slime.backends.megatron_utils.arguments import megatron_parse_args
    from slime.utils.arguments import (
        _pre_parse_mode,
        get_slime_extra_args_provider,
        slime_validate_args,
    )

    out = {}
    for name, extra in cases.items():
        saved, sys.argv = sys.argv, ["train.py", *MODEL, *extra]
        try:
            # slime's parse_args up to its validation (the sglang parse is not needed here).
            pre = _pre_parse_mode()
            args = megatron_parse_args(get_slime_extra_args_provider(), skip_hf_validate=True)
            for key, value in vars(pre).items():
                setattr(args, key, value)
            slime_validate_args(args)
            out[name] = ("ok", getattr(args, "micro_batch_planner_path", "absent"))
        except Exception as error:  # noqa: BLE001 - the test compares the type
            out[name] = (type(error).__name__, str(error))
        finally:
            sys.argv = saved
    return out


@needs_slime
def test_bad_options_are_refused_at_slimes_validation_in_its_flag_names(patched_slime):
    [out] = run_on_ranks(
        1,
        _validate_body,
        patched_slime,
        {name: argv for name, (argv, _) in {**BAD, **GOOD}.items()},
        layout=Layout(),
    )
    for name, (_, words) in BAD.items():
        kind, message = out[name]
        assert kind == "DynBatchValueError", (name, kind, message)
        assert words in message, (name, message)
        assert " -> " not in message, (name, message)  # no internal option mapping
    from megatron_dynbatch.integrations.slime.hook import HOOK_PATH

    for name, (_, on) in GOOD.items():
        assert out[name] == ("ok", HOOK_PATH if on else None), (name, out[name])


@needs_slime
def test_pristine_slime_validates_the_same_good_command_lines(stock_slime):
    [out] = run_on_ranks(
        1,
        _validate_body,
        stock_slime,
        {name: argv for name, (argv, _) in GOOD.items() if name in ("on", "off")},
        layout=Layout(),
    )
    assert out == {"on": ("ok", "absent"), "off": ("ok", "absent")}, out


# -- the way back: REINFORCE++ on a fully masked sample ------------------------------------------


def _rpp_args(planner):
    import types

    return types.SimpleNamespace(
        advantage_estimator="reinforce_plus_plus",
        use_rollout_logprobs=False,
        kl_coef=0.05,
        kl_loss_type="low_var_kl",
        custom_advantage_function_path=None,
        gamma=0.9,
        use_opd=False,
        normalize_advantages=False,
        use_dynamic_batch_size=planner is not None,
        micro_batch_planner_path=planner,
    )


def _rpp_data(masked):
    """Three samples; ``masked``: sample 1's loss mask is all 0 (a phantom, or a real one)."""
    import torch

    gen = torch.Generator().manual_seed(5)
    responses = [4, 3, 5]
    data = {
        "log_probs": [-torch.rand(n, generator=gen) for n in responses],
        "ref_log_probs": [-torch.rand(n, generator=gen) for n in responses],
        "rewards": [1.0, 0.5, -1.0],
        "response_lengths": responses,
        "total_lengths": [n + 2 for n in responses],
        "loss_masks": [torch.ones(n, dtype=torch.int) for n in responses],
    }
    data["loss_masks"][2][-1] = 0
    if masked:
        data["loss_masks"][1] = torch.zeros(3, dtype=torch.int)
    return data


def _rpp_body(slime_root, planner, drop):
    """slime's ``compute_advantages_and_returns`` (REINFORCE++) on the batch with sample 1 fully
    masked (``drop``: without sample 1): the returns, or the error it raised."""
    _import_slime(slime_root)
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns

    data = _rpp_data(masked=True)
    if drop:
        data = {k: [v for i, v in enumerate(values) if i != 1] for k, values in data.items()}
    try:
        compute_advantages_and_returns(_rpp_args(planner), data)
    except Exception as error:  # noqa: BLE001 - the test compares the type and message
        return (type(error).__name__, str(error))
    return ("ok", [r.clone() for r in data["returns"]])


@needs_slime
def test_reinforce_plus_plus_fully_masked_sample_with_the_switch_off_is_pristine(
    stock_slime, patched_slime
):
    """The exact way back: with the switch off (``--micro-batch-planner-path`` left ``None`` by
    slime's validation) patched slime stops where pristine slime stops, with slime's message."""
    [patched] = run_on_ranks(1, _rpp_body, patched_slime, None, False, layout=Layout())
    [stock] = run_on_ranks(1, _rpp_body, stock_slime, None, False, layout=Layout())
    assert stock == ("AssertionError", "Sequence at index 1 is fully masked."), stock
    assert patched == stock


@needs_slime
def test_reinforce_plus_plus_with_the_switch_on_zeroes_only_the_masked_sample(
    stock_slime, patched_slime
):
    import torch

    from megatron_dynbatch.integrations.slime.hook import HOOK_PATH

    [(kind, mine)] = run_on_ranks(1, _rpp_body, patched_slime, HOOK_PATH, False, layout=Layout())
    [(stock_kind, theirs)] = run_on_ranks(1, _rpp_body, stock_slime, None, True, layout=Layout())
    assert kind == stock_kind == "ok", (kind, stock_kind)
    assert torch.equal(mine[1], torch.zeros(3)), mine[1]
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[2], theirs[1])
    assert float(mine[0].abs().sum()) > 0  # the comparison is not of zeros
