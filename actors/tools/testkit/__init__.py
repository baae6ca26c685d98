"""Test scaffolding shared by the tests and the benchmarks; the library never imports it.

- ``harness.RemoteTarget``: a guarded, huge-page, pre-faulted memory region in
  another process, asleep while WRITEs land in it, for any transport backend.
- ``replay.replay_in_memory``: runs a whole plan into local byte buffers, the
  way trainers run it, so a plan can be checked byte for byte without NICs.
"""
