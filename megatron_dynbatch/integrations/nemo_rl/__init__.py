"""NeMo-RL's Megatron policy with megatron_dynbatch's plan (see :mod:`.plan`, :mod:`.shard` and
docs/nemo_rl.md)."""
