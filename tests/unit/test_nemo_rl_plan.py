"""NeMo-RL's shards from one global plan, from lengths alone (no NeMo-RL checkout needed)."""

import random

import pytest

from megatron_dynbatch.errors import DynBatchValueError
from megatron_dynbatch.integrations.nemo_rl.plan import (
    dynbatch_enabled,
    nemo_rl_planner_config,
    padded_lengths,
    plan_nemo_rl_shards,
)

pytestmark = pytest.mark.unit

PAD = 4


def _cfg(pp=2, vpp=1, budget=64, logprob=128, **flags):
    cfg = {
        "make_sequence_length_divisible_by": PAD,
        "dynamic_batching": {"enabled": flags.get("dynamic", False)},
        "sequence_packing": {
            "enabled": flags.get("packing", True),
            "train_mb_tokens": budget,
            "logprob_mb_tokens": logprob,
        },
        "megatron_cfg": {
            "enabled": flags.get("megatron", True),
            "pipeline_model_parallel_size": pp,
            "virtual_pipeline_model_parallel_size": vpp,
            "dynbatch": {"enabled": flags.get("enabled", True)},
        },
    }
    if vpp > 1 and "group" in flags:
        cfg["megatron_cfg"]["microbatch_group_size_per_vp_stage"] = flags["group"]
    return cfg


def _lengths(n, seed, top=60):
    rng = random.Random(seed)
    return [rng.randint(1, top) for _ in range(n)]


@pytest.mark.parametrize(
    "dp, pp, vpp, group",
    [(1, 2, 1, None), (2, 2, 1, None), (4, 2, 2, None), (2, 2, 2, 4), (8, 1, 1, None)],
)
@pytest.mark.parametrize("seed", range(5))
def test_every_sample_once_equal_counts_under_the_budget(dp, pp, vpp, group, seed):
    cfg = _cfg(pp=pp, vpp=vpp, **({"group": group} if group else {}))
    config = nemo_rl_planner_config(cfg, dp_size=dp, forward_only=False)
    gbs = 8 * dp
    lengths = _lengths(3 * gbs, seed)
    shards = plan_nemo_rl_shards(lengths, config, batch_size=gbs, pad_multiple=PAD)
    padded = padded_lengths(lengths, PAD)
    # Every sample exactly once, in its own global batch.
    seen = sorted(i for rows in shards.rows for i in rows if i is not None)
    assert seen == list(range(len(lengths)))
    multiple = (group or pp) if vpp > 1 else 1
    for g, count in enumerate(shards.num_microbatches):
        assert count % multiple == 0
        for r in range(dp):
            spans = shards.micro_batch_indices[r][g]
            assert len(spans) == count, "equal micro-batch counts on every DP rank"
            offset = sum(shards.elem_counts_per_gb(r)[:g])
            for (start, end), tokens in zip(spans, shards.micro_batch_lengths[r][g], strict=True):
                rows = shards.rows[r][offset + start : offset + end]
                real = [i for i in rows if i is not None]
                assert all(g * gbs <= i < (g + 1) * gbs for i in real)
                assert tokens <= 64, "the budget is a hard cap on the packed row"
                if real:
                    assert tokens == sum(padded[i] for i in real)
                else:
                    assert rows == (None,) and tokens == PAD, "a placeholder is one padded row"
    # NeMo-RL's reorder_data semantics: output[order[p]] = real row p, rank by rank.
    order = shards.sample_order()
    assert sorted(order) == list(range(len(lengths)))


def test_a_rank_with_only_placeholders_when_a_batch_has_fewer_samples_than_ranks():
    config = nemo_rl_planner_config(_cfg(), dp_size=2, forward_only=False)
    shards = plan_nemo_rl_shards([20, 30, 10], config, batch_size=1, pad_multiple=PAD)
    assert shards.num_microbatches == (1, 1, 1)
    real = [sum(i is not None for i in rows) for rows in shards.rows]
    # Each global batch's one sample runs on one rank; the other runs a placeholder row.
    assert [rows.count(None) for rows in shards.rows] == [3 - n for n in real]
    assert sum(real) == 3


def test_the_log_prob_pass_uses_logprob_mb_tokens():
    cfg = _cfg(pp=1, budget=32, logprob=128)  # pp 1: no bubble to fill with more micro-batches
    lengths = [30] * 8
    train = plan_nemo_rl_shards(lengths, nemo_rl_planner_config(cfg, dp_size=1, forward_only=False))
    forward = plan_nemo_rl_shards(
        lengths, nemo_rl_planner_config(cfg, dp_size=1, forward_only=True), forward_only=True
    )
    assert max(max(gb) for gb in train.micro_batch_lengths[0]) <= 32
    assert max(max(gb) for gb in forward.micro_batch_lengths[0]) <= 128
    assert sum(forward.num_microbatches) < sum(train.num_microbatches)


def test_a_sample_over_the_budget_names_the_key():
    config = nemo_rl_planner_config(_cfg(budget=32), dp_size=1, forward_only=False)
    with pytest.raises(
        DynBatchValueError, match=r"train_mb_tokens=32: sample 1 is 36 tokens .* to at least 36"
    ):
        plan_nemo_rl_shards([10, 33], config, pad_multiple=PAD)
    forward = nemo_rl_planner_config(_cfg(logprob=32), dp_size=1, forward_only=True)
    with pytest.raises(DynBatchValueError, match="logprob_mb_tokens"):
        plan_nemo_rl_shards([10, 33], forward, pad_multiple=PAD, forward_only=True)


def test_bad_batches_are_refused():
    config = nemo_rl_planner_config(_cfg(), dp_size=2, forward_only=False)
    with pytest.raises(DynBatchValueError, match="not a multiple of the global batch size 4"):
        plan_nemo_rl_shards([5] * 6, config, batch_size=4)
    with pytest.raises(DynBatchValueError, match="sample 1 has input_lengths=0"):
        plan_nemo_rl_shards([5, 0], config)
    with pytest.raises(DynBatchValueError, match="no sample"):
        plan_nemo_rl_shards([], config)


def test_the_switch_and_what_it_needs():
    assert dynbatch_enabled(_cfg()) is True
    assert dynbatch_enabled(_cfg(enabled=False)) is False
    assert dynbatch_enabled({"megatron_cfg": {"enabled": True}}) is False
    # `dynbatch:` with nothing under it, or `enabled:` with nothing: absent, off.
    assert dynbatch_enabled({"megatron_cfg": {"enabled": True, "dynbatch": None}}) is False
    assert dynbatch_enabled(_cfg(enabled=None)) is False
    cfg = _cfg()
    cfg["megatron_cfg"]["dynbatch"]["enable"] = True  # a typo is refused, not ignored
    with pytest.raises(DynBatchValueError, match=r"unknown key\(s\) \['enable'\]"):
        dynbatch_enabled(cfg)
    with pytest.raises(DynBatchValueError, match="is not a boolean"):
        dynbatch_enabled(_cfg(enabled="yes"))
    with pytest.raises(DynBatchValueError, match="policy.sequence_packing.enabled=true"):
        dynbatch_enabled(_cfg(packing=False))
    with pytest.raises(DynBatchValueError, match="policy.dynamic_batching.enabled=false"):
        dynbatch_enabled(_cfg(dynamic=True))
    with pytest.raises(DynBatchValueError, match="policy.megatron_cfg.enabled is false"):
        dynbatch_enabled(_cfg(megatron=False))


def test_budget_errors_name_nemo_rl_keys():
    with pytest.raises(
        DynBatchValueError,
        match=r"policy\.sequence_packing\.train_mb_tokens=0 must be > 0 with "
        r"policy\.megatron_cfg\.dynbatch\.enabled=true",
    ):
        nemo_rl_planner_config(_cfg(budget=0), dp_size=1, forward_only=False)
    with pytest.raises(DynBatchValueError) as refused:
        nemo_rl_planner_config(_cfg(logprob=-1), dp_size=1, forward_only=True)
    # NeMo-RL's key, without an internal "(in ...: option -> field)" mapping.
    assert str(refused.value).startswith("policy.sequence_packing.logprob_mb_tokens=-1 must be > 0")
    assert " -> " not in str(refused.value)
    # At config time too (the patched Policy.__init__ runs dynbatch_enabled first).
    with pytest.raises(DynBatchValueError, match=r"policy\.sequence_packing\.logprob_mb_tokens=-1"):
        dynbatch_enabled(_cfg(logprob=-1))
    with pytest.raises(DynBatchValueError, match=r"policy\.sequence_packing\.train_mb_tokens=0"):
        dynbatch_enabled(_cfg(budget=0))
    cfg = _cfg()
    del cfg["sequence_packing"]["logprob_mb_tokens"]
    with pytest.raises(DynBatchValueError, match="needs policy.sequence_packing.logprob_mb_tokens"):
        nemo_rl_planner_config(cfg, dp_size=1, forward_only=True)


def test_a_budget_under_one_padded_sample_and_both_switch_fixes_are_named_at_config_time():
    """Probes: a budget under make_sequence_length_divisible_by passed the config check and every
    batch was refused at its first pass; dynamic batching on with packing off named one fix,
    then refused the next."""
    for key, over in (("train_mb_tokens", {"budget": 2}), ("logprob_mb_tokens", {"logprob": 3})):
        with pytest.raises(
            DynBatchValueError, match=rf"sequence_packing\.{key}=\d holds no sample.*at least 4"
        ):
            dynbatch_enabled(_cfg(**over))
    assert dynbatch_enabled(_cfg(budget=4, logprob=4)) is True  # the named fix
    with pytest.raises(DynBatchValueError) as refused:
        dynbatch_enabled(_cfg(dynamic=True, packing=False))
    message = str(refused.value)
    assert "dynamic_batching.enabled=false and policy.sequence_packing.enabled=true" in message
    assert dynbatch_enabled(_cfg()) is True  # both fixes applied


def test_layout_errors_name_nemo_rl_keys():
    cfg = _cfg(pp=2, vpp=2, group=1)
    with pytest.raises(
        DynBatchValueError,
        match=r"smaller than policy\.megatron_cfg\.pipeline_model_parallel_size=2",
    ):
        nemo_rl_planner_config(cfg, dp_size=1, forward_only=False)


def test_the_record_reads_the_planner_beside_the_switch_and_names_it_in_errors():
    from megatron_dynbatch.integrations.hosts import HOSTS, NEMO_RL

    assert HOSTS["NeMo-RL"] is NEMO_RL and NEMO_RL.planning == "global"
    config = nemo_rl_planner_config(_cfg(), dp_size=2, forward_only=False)
    assert (config.planner, config.layout, config.oversize_samples) == (
        "dynbatch",
        "packed",
        "error",
    )
    cfg = _cfg()
    cfg["megatron_cfg"]["dynbatch"]["planner"] = "fixed"
    # ... and by the planner config too, for a direct caller (a probe: refused at the first step).
    with pytest.raises(DynBatchValueError, match=r"planner='fixed' plans padded rows only"):
        nemo_rl_planner_config(cfg, dp_size=2, forward_only=True)
    cfg["megatron_cfg"]["dynbatch"]["planner"] = "nope"
    with pytest.raises(
        DynBatchValueError, match=r"planner='nope' \(policy\.megatron_cfg\.dynbatch\.planner\)"
    ):
        nemo_rl_planner_config(cfg, dp_size=2, forward_only=False)
    # Refused at start-up, where the patched Policy checks its config.
    with pytest.raises(DynBatchValueError, match=r"dynbatch\.planner='nope': no planner named"):
        dynbatch_enabled(cfg)
    # 'fixed' plans padded rows; NeMo-RL's sequence packing runs packed ones: refused here, not
    # by the planner at the first step.
    cfg["megatron_cfg"]["dynbatch"]["planner"] = "fixed"
    with pytest.raises(DynBatchValueError, match=r"planner='fixed' plans padded rows only"):
        dynbatch_enabled(cfg)
    cfg["megatron_cfg"]["dynbatch"]["planner"] = "dynbatch-thorough"
    assert dynbatch_enabled(cfg)


def test_a_told_overhead_reaches_the_planner_and_a_bad_one_is_refused_at_start_up():
    """``policy.megatron_cfg.dynbatch.cost_microbatch_overhead``: one micro-batch's fixed cost in
    tokens of linear work. Told, the planner trusts it (training and log-prob passes); unset, it
    assumes 2% of a full micro-batch; anything but a finite number >= 0 is refused where the
    patched Policy checks its config, naming NeMo-RL's key and a value that works."""
    import math
    import re

    key = "policy.megatron_cfg.dynbatch.cost_microbatch_overhead"
    assumed = nemo_rl_planner_config(_cfg(), dp_size=2, forward_only=False)
    assert assumed.overhead_assumed is True
    cfg = _cfg()
    cfg["megatron_cfg"]["dynbatch"]["cost_microbatch_overhead"] = None  # YAML `null`: not told
    assert dynbatch_enabled(cfg)
    assert nemo_rl_planner_config(cfg, dp_size=2, forward_only=False).overhead_assumed is True
    for value in (330, 0):
        cfg["megatron_cfg"]["dynbatch"]["cost_microbatch_overhead"] = value
        assert dynbatch_enabled(cfg)
        for forward_only in (False, True):
            told = nemo_rl_planner_config(cfg, dp_size=2, forward_only=forward_only)
            assert told.overhead_assumed is False
            assert told.cost.microbatch_overhead == float(value)
    for value in (-1, math.nan, math.inf, "lots", True):
        cfg["megatron_cfg"]["dynbatch"]["cost_microbatch_overhead"] = value
        for check in (
            lambda: dynbatch_enabled(cfg),
            lambda: nemo_rl_planner_config(cfg, dp_size=2, forward_only=False),
        ):
            with pytest.raises(DynBatchValueError, match=re.escape(f"{key}={value!r} must")) as e:
                check()
            assert f"e.g. {key}=330 " in str(e.value) and "\n" not in str(e.value)


def test_at_pp_1_rows_are_planned_at_their_own_length_as_nemo_rl_runs_them():
    """At PP 1 NeMo-RL's packing runtime runs each micro-batch's THD row at its own length, so
    the planner balances the ranks' tokens, not their micro-batch counts. Planned as one row
    length for the step (as at PP > 1, where NeMo-RL pads a rank's rows to its largest pack), a
    rank of eight GRPO samples took four while two took one: 6.5% slower than NeMo-RL's own
    dynamic batching (``benchmarks.nemo_rl_as_run --seed 4``, case 148)."""
    from benchmarks.nemo_rl_as_run import (
        NemoRlCase,
        _dynamic_costs,
        _packed_costs,
        _step,
        ours,
        true_cost,
    )

    lengths = [2870, 3474, 1456, 935, 3337, 1705, 1594, 1663]
    case = NemoRlCase("seed 4 #148", lengths, dp=4, pad_multiple=2, train_mb_tokens=4096)
    for fraction in (0.0, 0.05):
        cost = true_cost(case, fraction, 24576)
        planned = ours(case, 1)
        assert sorted(n for rank in planned for mb in rank for n in mb if n > 2) == sorted(
            padded_lengths(lengths, 2)
        )
        theirs = _step(_dynamic_costs(case, cost), 1)
        assert _step(_packed_costs(planned, 1, cost), 1) <= theirs * 1.005
        # The heaviest rank holds at most the mean's tokens plus its smallest sample.
        assert max(sum(map(sum, rank)) for rank in planned) <= sum(lengths) / 4 + min(lengths) + 4
    assert nemo_rl_planner_config(_cfg(pp=1), dp_size=4, forward_only=False).variable_row_lengths
    assert not nemo_rl_planner_config(
        _cfg(pp=2), dp_size=4, forward_only=False
    ).variable_row_lengths


def test_unknown_keys_are_refused_on_and_only_warned_of_while_off():
    # Off is stock NeMo-RL, which reads nothing of the section: an unknown key was refused there
    # too. A misspelt switch (`enable: true`) is still said.
    off = _cfg(enabled=False)
    off["megatron_cfg"]["dynbatch"]["enable"] = True
    with pytest.warns(UserWarning, match=r"unknown key\(s\) \['enable'\], ignored while"):
        assert dynbatch_enabled(off) is False
    on = _cfg()
    on["megatron_cfg"]["dynbatch"]["enable"] = True
    with pytest.raises(DynBatchValueError, match=r"unknown key\(s\) \['enable'\]"):
        dynbatch_enabled(on)


def test_quantile_balancing_is_refused_at_start_up_naming_its_key():
    # NeMo-RL's patched MoE forward passes our padding mask, which megatron-core 0.19.2's
    # quantile balancing asserts on at the first step.
    cfg = _cfg()
    cfg["megatron_cfg"]["moe_router_load_balancing_type"] = "quantile_balancing"
    key = r"policy\.megatron_cfg\.moe_router_load_balancing_type='quantile_balancing'"
    with pytest.raises(DynBatchValueError, match=key):
        dynbatch_enabled(cfg)
    cfg["megatron_cfg"]["moe_router_load_balancing_type"] = "none"
    assert dynbatch_enabled(cfg)
