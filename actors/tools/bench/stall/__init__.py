"""``wt bench stall``: how long generation stalls around an update, per pause mode.

``bench.py`` is the command; ``vllm.py`` vLLM's engines.
"""
