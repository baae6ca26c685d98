"""Tooling, not library: the ``wt`` command line, benchmarks, the demo and the test kit.

Library code never imports anything under ``actors.tools`` (tests/unit/test_layering.py).
"""
