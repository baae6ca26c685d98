"""Which transport a run uses, and its options: typed, validated, one model per backend.

A :class:`TransportSpec` is plain data (picklable; it crosses Ray inside the
controller's config): the backend's name and its options, each backend's
options a frozen pydantic model that refuses unknown names and values of the
wrong type (strict: ``"2"`` is not a number, ``1.5`` not an integer). Each
backend class carries its model (``cls.Options``, a
:class:`~weight_transfer.transport.base.TransportOptions`), and decides how a spec
opens a NIC (``cls.open_kwargs``); nothing here knows a backend by name::

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
from typing import Annotated, Any

import pydantic

from weight_transfer.config_files import FieldError, format_validation_error
from weight_transfer.transport.base import TransportOptions as BaseOptions
from weight_transfer.transport.registry import (
    DEFAULT_TRANSPORT_NAME,
    check_transport_name,
    make_transport,
    registered_transports,
    transport_class,
)

# Any backend's options model: each backend class carries its own (``cls.Options``).
TransportOptions = BaseOptions


def options_model(kind: str) -> type[BaseOptions]:
    """The options model of registered transport ``kind`` (imports the backend)."""
    return transport_class(kind).Options


def _check_name(value: Any) -> str:
    return check_transport_name(value, where="transport")


# A field holding a transport name: validated against the registry (run configs).
TransportName = Annotated[str, pydantic.AfterValidator(_check_name)]


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportSpec:
    """A validated transport choice; build with :func:`parse_transport`."""

    kind: str
    options: TransportOptions

    def describe(self) -> str:
        changed = self.options.model_dump(exclude_defaults=True)
        return self.kind + (f" {changed}" if changed else "")

    @property
    def backend(self) -> type:
        """The backend class (imported on first use)."""
        return transport_class(self.kind)

    def kwargs(self, *, address: str = "", node: str = "") -> dict[str, Any]:
        """Constructor keywords of the backend for a NIC on host ``address``, node ``node``
        (the backend's ``open_kwargs`` decides what each fills)."""
        return self.backend.open_kwargs(self.options, node=node, address=address)

    def open(self, *, owner: str, nic: str, node: str = "", address: str = "") -> Any:
        """One NIC of this transport for ``owner`` (the registry builds it)."""
        kwargs = self.kwargs(address=address, node=node)
        return make_transport(self.kind, owner=owner, nic=nic, **kwargs)


def parse_transport(kind: Any, options: Any = None, *, where: str = "",
                    who: str = "every trainer and engine NIC") -> TransportSpec:
    """Validate a transport name and its options; a ValueError (a
    :class:`~weight_transfer.config_files.FieldError`) names ``where`` and the field
    (``where`` "": the field alone, for a model validator that puts its location in front)."""

    def at(field: str) -> str:
        return f"{where}.{field}" if where else field

    if not isinstance(kind, str) or kind not in registered_transports():
        raise FieldError(f"{at('transport')}: unknown transport {kind!r} (used by {who}); "
                         f"known: {list(registered_transports())}")
    model = options_model(kind)
    if isinstance(options, model):
        return TransportSpec(kind=kind, options=options)
    if isinstance(options, BaseOptions):
        raise FieldError(f"{at('transport_options')}: {type(options).__name__} given for "
                         f"transport {kind!r} (used by {who}); expected {model.__name__}")
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise FieldError(f"{at('transport_options')}: must be a mapping of option names to "
                         f"values, not {type(options).__name__} (transport {kind!r}, used by "
                         f"{who})")
    unknown = sorted(set(map(str, options)) - set(model.model_fields))
    if unknown:
        raise FieldError(f"{at('transport_options')}: unknown option(s) {unknown} for transport "
                         f"{kind!r} (used by {who}); known: {sorted(model.model_fields)}")
    try:
        parsed = model.model_validate(dict(options))
    except pydantic.ValidationError as exc:
        detail = format_validation_error(exc, prefix=f"{at('transport_options')}.")
        raise FieldError(f"{detail} (transport {kind!r}, used by {who}; got "
                         f"{dict(options)})") from None
    return TransportSpec(kind=kind, options=parsed)


def default_spec(kind: str) -> TransportSpec:
    """``kind`` with its default options."""
    return parse_transport(kind, None, where="default")


DEFAULT_TRANSPORT = default_spec(DEFAULT_TRANSPORT_NAME)
