"""Reference implementations: the demo's inference engine and the oracles the tests use.

Nothing in ``weight_transfer`` or ``scheduling`` imports this package; ``actors``
and ``scripts`` use the reference engine as the default inference engine, and the
tests use the loader and the trainer model as independent oracles.

- ``engine.ReferenceEngine`` (with ``layers``, ``ops``, ``buffer``): a small TP
  decoder holding its weights in vLLM's layout inside one registrable buffer,
  with greedy generation; ``adapter.ReferenceEngineAdapter`` pauses it at a step
  boundary for :class:`weight_transfer.engines.adapter.EngineAdapter`.
- ``loader.load_engine_shard``: one engine rank's tensors (vLLM names and TP/EP
  shards, optional FP8) from a Hugging Face state dict, written the way vLLM's
  ``load_weights`` is and sharing no code with the plan's layout.
- ``hf_model``: the trainer's transformers model built from our configs, and the
  float32 greedy generation oracle.
- ``random_state.random_state_dict``: seeded random weights of a tiny config.
"""
