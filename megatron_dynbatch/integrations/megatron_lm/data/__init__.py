"""Samples for the Megatron-LM entry: indexed documents, SFT conversations, byte-level preprocessing."""
