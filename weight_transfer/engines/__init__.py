"""Inference-engine side: loaders, a reference engine and the adapter weight transfer uses.

- ``hf_load.load_engine_shard``: one engine rank's tensors (vLLM names and TP/EP
  shards, optional FP8) from a Hugging Face state dict, the vLLM way; the
  independent reference the layout tests compare against.
- ``reference.ReferenceEngine``: a small TP decoder (llama, qwen2, qwen3,
  qwen3_moe) holding its weights in vLLM's layout inside one registrable buffer,
  with greedy generation; the demo's and tests' inference engine.
- ``adapter.EngineAdapter``: what weight transfer needs from any engine: its
  buffers for registration and pause/resume hooks. The engine is not modified.
- ``hf_model``: the trainer's transformers model built from our configs, and the
  float32 greedy generation oracle.
"""
