"""``wt bench designs``: our design against the field's designs on one fleet, side by side.

``bench.py`` is the command; ``fleet.py`` the per-engine fleets; ``vllm.py`` vLLM's;
``report.py`` the table.
"""
