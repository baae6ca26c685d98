"""Trainer sources: how a trainer rank's live model describes and hands out its parameters.

One module per training framework, found by name through :mod:`.registry`:
``fsdp2`` (DTensors, :mod:`.fsdp`), ``deepspeed`` (ZeRO stages 0-3, :mod:`.deepspeed`) and
``megatron`` (a Megatron-core GPTModel's TP shards, :mod:`.megatron`).
"""
