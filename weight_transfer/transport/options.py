"""Which transport a run uses, and its options: typed, validated, one model per backend.

A :class:`TransportSpec` is plain data (picklable; it crosses Ray inside the
controller's config): the backend's name and its options, each backend's
options a frozen pydantic model that refuses unknown names and values of the
wrong type (strict: ``"2"`` is not a number, ``1.5`` not an integer)::

    spec = parse_transport("mooncake", {"protocol": "tcp"}, where="TransferConfig")
    nic = spec.open(owner="trainer0", nic="tnode0/nic0", node=node_id, address="10.0.0.7")

:func:`parse_transport` raises one ``ValueError`` naming ``where``, the field
(``transport`` or ``transport_options.<name>``) and what was expected.
``spec.open`` builds the NIC through :func:`~weight_transfer.transport.make_transport`
(:mod:`.registry`, the one registry). Which hosts a spec reaches:
:func:`weight_transfer.transport.handshake.reaches`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from weight_transfer.config_files import format_validation_error
from weight_transfer.transport.registry import make_transport


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class SimNicOptions(_Options):
    """Simulated NIC (one host): a bandwidth cap and added latency model a real fabric."""

    bandwidth_gbps: float | None = Field(default=None, gt=0)  # GB/s per NIC; None: memcpy speed
    latency_us: float = Field(default=0.0, ge=0)
    max_inflight: int = Field(default=4, ge=1)
    chunk_bytes: int = Field(default=8 << 20, ge=4096)


class MooncakeOptions(_Options):
    """Mooncake TransferEngine: ``hostname`` None takes each actor's own host address."""

    protocol: Literal["tcp", "rdma"] = "tcp"
    hostname: str | None = None
    device_name: str = ""
    max_inflight: int = Field(default=8, ge=1)
    chunk_bytes: int = Field(default=64 << 20, ge=1)
    timeout_s: float = Field(default=30.0, gt=0)
    connect_timeout_s: float = Field(default=20.0, gt=0)


class RdmaOptions(_Options):
    """pyverbs RC queue pairs: device (None: the first), port, GID index (RoCE needs one)."""

    device: str | None = None
    port: int = Field(default=1, ge=1)
    gid_index: int = Field(default=0, ge=0)
    max_inflight: int = Field(default=16, ge=1)
    chunk_bytes: int = Field(default=16 << 20, ge=1)
    timeout: int = Field(default=14, ge=0, le=31)
    retry_cnt: int = Field(default=7, ge=0, le=7)


# Backend name -> its options model (the backends themselves: transport.BACKENDS).
OPTIONS: dict[str, type[_Options]] = {
    "simnic": SimNicOptions,
    "mooncake": MooncakeOptions,
    "rdma": RdmaOptions,
}
TransportOptions = SimNicOptions | MooncakeOptions | RdmaOptions


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportSpec:
    """A validated transport choice; build with :func:`parse_transport`."""

    kind: str
    options: TransportOptions

    def describe(self) -> str:
        changed = self.options.model_dump(exclude_defaults=True)
        return self.kind + (f" {changed}" if changed else "")

    def kwargs(self, *, address: str = "") -> dict[str, Any]:
        """Constructor keywords of the backend; ``address`` fills mooncake's ``hostname``."""
        out = self.options.model_dump()
        if self.kind == "mooncake" and out["hostname"] is None:
            out["hostname"] = address or "127.0.0.1"
        return out

    def open(self, *, owner: str, nic: str, node: str = "", address: str = "") -> Any:
        """One NIC of this transport for ``owner`` (the registry builds it)."""
        kwargs = self.kwargs(address=address)
        if self.kind != "mooncake":
            kwargs["node"] = node
        return make_transport(self.kind, owner=owner, nic=nic, **kwargs)


def parse_transport(kind: Any, options: Any = None, *, where: str,
                    who: str = "every trainer and engine NIC") -> TransportSpec:
    """Validate a transport name and its options; ValueError names ``where`` and the field."""
    if not isinstance(kind, str) or kind not in OPTIONS:
        raise ValueError(f"{where}.transport: unknown transport {kind!r} (used by {who}); "
                         f"known: {sorted(OPTIONS)}")
    model = OPTIONS[kind]
    if isinstance(options, model):
        return TransportSpec(kind=kind, options=options)
    if isinstance(options, _Options):
        raise ValueError(f"{where}.transport_options: {type(options).__name__} given for "
                         f"transport {kind!r} (used by {who}); expected {model.__name__}")
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ValueError(f"{where}.transport_options: must be a mapping of option names to "
                         f"values, not {type(options).__name__} (transport {kind!r}, used by "
                         f"{who})")
    unknown = sorted(set(map(str, options)) - set(model.model_fields))
    if unknown:
        raise ValueError(f"{where}.transport_options: unknown option(s) {unknown} for transport "
                         f"{kind!r} (used by {who}); known: {sorted(model.model_fields)}")
    try:
        parsed = model.model_validate(dict(options))
    except pydantic.ValidationError as exc:
        detail = format_validation_error(exc).replace("field ", f"{where}.transport_options.")
        raise ValueError(f"{detail} (transport {kind!r}, used by {who}; got "
                         f"{dict(options)})") from None
    return TransportSpec(kind=kind, options=parsed)


DEFAULT_TRANSPORT = TransportSpec(kind="simnic", options=SimNicOptions())
