"""Inference-engine side: loaders and adapters that expose an engine's tensors.

``hf_load.load_engine_shard`` builds one engine rank's tensors (vLLM names and
TP/EP shards, optional FP8) from a Hugging Face state dict, the vLLM way; it is
the independent reference the layout tests compare against.
"""
