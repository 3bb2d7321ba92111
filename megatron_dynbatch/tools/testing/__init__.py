"""Test and self-check support, not library surface: the tiny deterministic GPT and the gloo pool.

``tiny_gpt``: a real Megatron-Core ``GPTModel`` whose weights depend only on a seed and each
parameter's global name, so every pipeline layout and a one-process reference hold the same numbers
(used by the tests, ``megatron-dynbatch verify`` and the benchmarks). ``workers``: a persistent pool
of gloo processes that runs one function on N ranks. Both import megatron / torch.distributed and
are only imported by code that needs them.
"""
