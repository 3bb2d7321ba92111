"""Samples for the Megatron-LM entry: indexed documents, SFT conversations, and building `.bin/.idx`.

Building: ``preprocess`` (byte tokens, or any Megatron tokenizer with Megatron-LM's own options) and
``megatron_tool`` (Megatron-LM's ``tools/preprocess_data.py`` run unmodified in this environment).
"""
