"""SkyRL's Megatron backend: the plan of a DP-sharded mini-batch (``plan``) and the micro-batch
iterator the patched worker uses when ``trainer.use_dynamic_batch_size`` is on (``iterator``)."""
