"""Adapters for RL trainers that run Megatron (slime-style rollout batches)."""
