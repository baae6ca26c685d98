"""Engine-neutral pieces of learning a layout from an engine's own loader.

An engine adapter that drives its engine's ``load_weights`` with recording
tensors (vLLM's: :mod:`weight_transfer.engines.vllm.recording`) turns what it
saw into plan pieces with these modules, which import no engine, no Ray and no
torch:

* :mod:`.slices`: one recorded copy (an op chain over a checkpoint tensor into a
  strided view of an engine tensor) -> contiguous ``COPY`` pieces;
* :mod:`.fp8`: recorded pieces of a block-FP8 checkpoint -> ``FP8_WEIGHT`` /
  ``FP8_SCALE`` pieces sourced from the trainer's own weight;
* :mod:`.checkpoint`: the tensors of a safetensors checkpoint, from its headers.
"""
