"""verl's Megatron engine with megatron_dynbatch's plan (see :mod:`.engine` and docs/verl.md)."""
