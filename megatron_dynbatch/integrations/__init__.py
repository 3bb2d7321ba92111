"""One sub-package per host trainer: Megatron-LM's ``pretrain()`` and slime."""
