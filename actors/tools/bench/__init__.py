"""Benchmarks: each runs a measurement and a baseline in the same run and verifies what
landed. ``designs`` (ours against rank-0 broadcast, per-tensor RPC and bucketed
broadcast, with the baselines in :mod:`~actors.tools.bench.baselines`,
:mod:`~actors.tools.bench.baselines_vllm` and their pacing), ``transport``, ``pipeline``,
``staging``, ``gather``, ``integrity``, and ``calibrate`` (the simulator's stage costs
measured here). Each is a ``wt bench ...`` command (:mod:`actors.tools.cli.main`).
"""
