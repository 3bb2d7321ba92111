"""Running a planned step on Megatron-Core: agreement, schedule call, forward step, train / forward-only.

The layer below the integrations that runs ``megatron.core``; it never reads
``megatron.training`` arguments (process groups and sizes are passed in). The CPU support
(:mod:`megatron_dynbatch.cpu`) also imports ``megatron.core`` (and ``megatron.training``), but only
to redirect its CUDA uses when no GPU is there, applied by explicit call.
"""
