"""megatron_dynbatch: dynamic, token-budget micro-batching for Megatron-Core pipelines.

The package top level stays import-light: the planner (``megatron_dynbatch.planning``) is pure Python,
and only ``runtime`` and ``megatron`` import torch / megatron.core.
"""

__version__ = "0.1.0"
