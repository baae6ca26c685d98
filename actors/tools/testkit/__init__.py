"""Test scaffolding shared by the tests and the benchmarks; the library never imports it.

- ``harness.RemoteTarget``: a guarded, huge-page, pre-faulted memory region in
  another process, asleep while WRITEs land in it, for any transport backend.
- ``replay.replay_in_memory``: runs a whole plan into local byte buffers, the
  way trainers run it, so a plan can be checked byte for byte without NICs.
- ``simnic_engines.SimnicEngines``: engine regions on simulated NICs in this process,
  written by the real executor from what a source hands it (unit tests of sources).
- ``source_fleet``: trainer actors on one gloo group and reference replicas at TP 1
  and 2 (the DeepSpeed and Megatron integration tests).
- ``megatron_cpu``: a small Megatron-core GPTModel from a model file, on CPU.
- ``lora_oracle``: a random PEFT adapter, its checkpoint, and the LoRA slot oracle (the
  served slot's bytes against vLLM's own load of that checkpoint, in the worker).
- ``cpu_profile``: where a command's CPU time goes, by kind of process (sampled from
  ``/proc``; ``scripts/suite_cpu.py`` runs the suite under it).
"""
