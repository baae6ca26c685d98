"""What the trainers and the vLLM workers tell each other about a LoRA adapter (plain data).

* :class:`AdapterSpec` - the trainer's adapter: its PEFT config (``r``, ``lora_alpha``,
  ``target_modules``, rsLoRA ...) and its parameters in PEFT's checkpoint naming
  (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), as
  ``save_pretrained`` would write them. The base weights are not part of it.
* :class:`LoraSetup` - the driver's request to a worker: the adapter, the name and id
  the user's ``LoRARequest`` serves it under, and where to register memory.
* :class:`LoraRankMeta` - a worker's answer: its registered slot tensors (vLLM's
  ``lora_a_stacked`` / ``lora_b_stacked``, whole, one region each), the two slots it
  owns, and per slot the pieces recorded from vLLM's own ``set_lora`` (which bytes of
  which adapter parameter land where), plus each ``lora_B`` parameter's scaling
  (vLLM folds ``alpha/r`` into B when it loads an adapter; :func:`prepare_lora_piece`
  does the same: cast to the slot dtype, then multiply).

The plan of an adapter update is therefore static: both slots' pieces are known at
setup, and each update writes the pieces of the slot the engine names as free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from weight_transfer.types import EngineRankMeta, Piece, TensorSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterSpec:
    """A PEFT LoRA adapter as the trainer holds it (see the module docstring)."""

    config_json: str  # PEFT's adapter config (LoraConfig.to_dict()), as JSON
    params: tuple[TensorSpec, ...]  # PEFT checkpoint names, global shapes

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json)

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def alpha(self) -> float:
        return float(self.config["lora_alpha"])

    @property
    def targets(self) -> tuple[str, ...]:
        t = self.config.get("target_modules") or ()
        return (t,) if isinstance(t, str) else tuple(t)

    @classmethod
    def of(cls, config: dict[str, Any], params: dict[str, tuple[tuple[int, ...], str]]
           ) -> AdapterSpec:
        """From a PEFT config dict and ``{name: (shape, dtype)}``."""
        clean = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
        return cls(config_json=json.dumps(clean, sort_keys=True, default=str),
                   params=tuple(TensorSpec(name=n, shape=tuple(s), dtype=d)
                                for n, (s, d) in sorted(params.items())))


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraSetup:
    """Own two adapter slots for ``name`` (one served, one being written) and record them."""

    adapter: AdapterSpec
    name: str  # the LoRARequest name the user serves the adapter under
    lora_int_id: int  # its LoRARequest id
    replica: str
    nics: tuple[tuple[str, ...], ...]  # per TP rank (the NICs of the base setup, if any)
    transport: Any = None  # TransportSpec; None: the base setup's
    node: str = ""
    address: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraRankMeta:
    """One TP rank's adapter slots (see the module docstring)."""

    engine: EngineRankMeta  # the registered slot tensors (no pieces of its own)
    name: str
    lora_int_id: int
    slots: tuple[int, ...]  # vLLM slot indexes owned: (served now, free now) at setup
    slot_pieces: tuple[tuple[Piece, ...], ...]  # per owned slot, in ``slots`` order
    scaling: tuple[tuple[str, float], ...]  # lora_B parameter -> the factor vLLM folds in
    params: tuple[TensorSpec, ...] = field(default=())  # the adapter's, as set up

    def pieces(self, slot: int) -> tuple[Piece, ...]:
        if slot not in self.slots:
            raise ValueError(f"{self.engine.replica}/tp{self.engine.rank}: slot {slot} is not "
                             f"one of the adapter {self.name!r}'s slots {self.slots}")
        return self.slot_pieces[self.slots.index(slot)]

    def scale(self, param: str) -> float:
        return dict(self.scaling).get(param, 1.0)

    @property
    def nbytes(self) -> int:
        """Bytes one adapter version writes into this rank."""
        return sum(p.nbytes for p in self.slot_pieces[0])


def prepare_lora_piece(full: torch.Tensor, piece: Piece, scale: float) -> torch.Tensor:
    """The bytes of ``piece`` as vLLM's own adapter load makes them: the rectangle cast to
    the slot dtype, then (lora_B) multiplied by the scaling, as ``LoRALayerWeights.optimize``
    does after loading."""
    from weight_transfer.sender.prepare import as_bytes, prepare_piece

    out = prepare_piece(full, piece)
    if scale != 1.0:
        out = out * scale  # a new tensor: ``out`` may be a view of the trainer's parameter
    return as_bytes(out)


def prepare_lora_piece_into(full: torch.Tensor, piece: Piece, scale: float,
                            out: torch.Tensor) -> torch.Tensor:
    """:func:`prepare_lora_piece` written into ``out`` (flat uint8, ``piece.nbytes``): the
    cast, then the scaling in place in the slot dtype (as vLLM's ``lora_b *= scaling``)."""
    from weight_transfer.sender.prepare import prepare_pieces_into

    (ready,) = prepare_pieces_into(full, [piece], [out])
    if scale != 1.0:
        ready.view(getattr(torch, piece.dst_dtype)).mul_(scale)
    return ready


def check_tensors(meta: LoraRankMeta, tensors: dict[str, torch.Tensor]) -> None:
    """ValueError naming every parameter the update lacks, adds or reshapes against the
    adapter set up (checked before anything is written)."""
    want = {p.name: tuple(p.shape) for p in meta.params}
    got = {n: tuple(t.shape) for n, t in tensors.items()}
    problems = [f"{n}: missing (set up with shape {s})" for n, s in want.items() if n not in got]
    problems += [f"{n}: not a parameter of the adapter set up" for n in got if n not in want]
    problems += [f"{n}: shape {got[n]}, set up with {s}" for n, s in want.items()
                 if n in got and got[n] != s]
    if problems:
        raise ValueError(f"adapter update for {meta.name!r} does not match its setup:\n  "
                         + "\n  ".join(sorted(problems)))
