"""``wt bench lora``: LoRA adapter updates into vLLM, three designs side by side."""

from actors.tools.bench.lora.bench import run

__all__ = ["run"]
