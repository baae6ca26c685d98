"""Run at the start of every Python process the test suite starts: ``tests/conftest.py``
puts this folder first on ``PYTHONPATH``, which Ray nodes and their workers, vLLM's
processes, spawned ranks and ``wt`` commands inherit (a process given an environment of its
own without it runs as before).

A young generation of 10000 objects before the cyclic garbage collector runs, not
CPython's 700. Importing torch, transformers and vLLM allocates millions of objects, most
of them for good, and at 700 the collector walks them again and again: a trainer rank's
imports took 3.55 CPU-s with the default and 2.80 with this, vLLM's engine core's 5.85 and
4.71, at the same peak memory. The suite starts some 400 such processes on 2 cores, so this
is the suite's budget, not a behaviour: no test depends on when garbage is collected
(those that need it collected call ``gc.collect()``), and the library sets no threshold.
"""

import gc

gc.set_threshold(10_000, 10, 10)
