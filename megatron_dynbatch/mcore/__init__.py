"""Running a planned step on Megatron-Core: agreement, schedule call, forward step, train / forward-only.

The only layer below the integrations that imports ``megatron.core``; it never reads
``megatron.training`` arguments (process groups and sizes are passed in).
"""
