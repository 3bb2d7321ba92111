"""One sub-package per host trainer: Megatron-LM's ``pretrain()`` (``megatron_lm``), slime,
SkyRL and verl (each entry point is listed in docs/api.md)."""
