"""The CPU support: the few CUDA uses of Megatron redirected so it runs on gloo without a GPU.

Applied only by explicit call and only where CUDA is absent (see docs/cpu.md). ``core_shim``:
megatron.core's schedules and models; ``training_shim``: Megatron-LM's ``pretrain()`` on top.
"""
