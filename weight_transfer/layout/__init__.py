"""Engine-side layout: fused tensors, TP/EP shard geometry, FP8 blocks and quantization.

``recording/`` learns the layout from the engine itself (vLLM's ``load_weights``).
"""
