"""slime: the drop-in ``build_dp_schedule`` (``schedule``), what the patched backend calls
(``backend``), and ``DynamicBatching`` for other trainers that keep slime's rollout dicts."""
