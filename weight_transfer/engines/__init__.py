"""Inference engines: the engine-rank contract, its shared implementation, and the registry.

* :mod:`.rank`: :class:`~.rank.EngineRank`, every method the controller calls on an
  engine rank (named by protocol member, never by string);
* :mod:`.fence` and :mod:`.registered`: the one implementation every engine uses
  (epoch fence, version, events; NIC registration, connection set-up, peer copy,
  checksums, statistics);
* :mod:`.registry`: an engine's name, resolved once, to its launch function and
  the command line's hooks (``reference``, ``vllm``, or one registered by a user);
* ``vllm``: our backend for vLLM's weight-transfer plugin API.

Each engine package is imported lazily by the engine itself; nothing here
imports an engine (or Ray) at import time.
"""
