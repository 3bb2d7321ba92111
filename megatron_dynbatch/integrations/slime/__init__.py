"""slime: the hook the patches reach us through (``hook.MicroBatchPlanner``, named by
``--micro-batch-planner-path``), the drop-in ``build_dp_schedule`` (``schedule``), what the patched
backend calls (``backend``), and ``DynamicBatching`` for other trainers that keep slime's rollout
dicts."""
