"""Adapters for real inference engines (``vllm``: vLLM's weight-transfer plugin API).

Each engine package is imported lazily by the engine itself; nothing here
imports an engine at import time.
"""
