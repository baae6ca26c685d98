"""The byte oracle as a vLLM worker extension, for a server (``vllm serve``) in tests and the demo.

A server started with ``--worker-extension-cls
actors.tools.testkit.vllm_oracle_ext.OracleExtension`` answers the dev route
``POST /collective_rpc {"method": "wt_oracle_check", "args": [checkpoint]}``
with, per worker, ``{"problems": [...], "digests": {...}}``: the same check as
:func:`actors.tools.testkit.vllm_oracle.oracle_check` (every registered byte against vLLM's
own ``load_weights`` of ``checkpoint``), reached by name with string arguments,
so no callable crosses the wire (no insecure serialization). The LoRA slot oracle
(:mod:`actors.tools.testkit.lora_oracle`) answers by name too: ``wt_lora_slot_differences``
and ``wt_lora_slot_ids`` (an ``AsyncLLM``'s ``collective_rpc``, a server's route), and
``wt_lora_load``: vLLM's own load of a PEFT checkpoint into a slot (a server's oracle).
"""

from __future__ import annotations

from typing import Any

EXTENSION = "actors.tools.testkit.vllm_oracle_ext.OracleExtension"


class OracleExtension:
    """Mixed into vLLM's worker class by vLLM (``worker_extension_cls``)."""

    def wt_oracle_check(self, checkpoint: str) -> dict[str, Any]:
        from actors.tools.testkit.vllm_oracle import oracle_check

        problems, digests = oracle_check(self, checkpoint)
        return {"problems": problems, "digests": digests}

    def wt_lora_slot_differences(self, served_id: int, oracle_id: int) -> list[str]:
        from actors.tools.testkit.lora_oracle import slot_differences

        return slot_differences(self, served_id, oracle_id)

    def wt_lora_slot_ids(self) -> list[int | None]:
        from actors.tools.testkit.lora_oracle import slot_ids

        return slot_ids(self)

    def wt_lora_load(self, name: str, lora_int_id: str, path: str) -> bool:
        from actors.tools.testkit.lora_oracle import load_checkpoint

        return load_checkpoint(self, name, lora_int_id, path)
