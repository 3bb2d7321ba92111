"""Megatron-LM's ``pretrain()`` with dynamic batching: arguments, the training-loop hooks the
patches call, the entry (``pretrain_gpt``), the patched ``megatron/training`` tree, and ``data/``.
"""
