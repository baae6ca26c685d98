"""Benchmarks on a fleet their caller started (``fleet=``): the checks and the versions.

``wt bench designs`` and ``wt bench stall`` start their engine's fleet themselves; a caller
(the tests: one vLLM fleet for both benches) may hand them a running one instead, which
they leave running. Updates then go on from the fleet's versions: a controller refuses a
version that is not above the last one it attempted (``check_version`` in
:mod:`actors.controller.update`), so a bench starts one above it::

    check_fleet(fleet, engine, "wt bench stall")   # ValueError: another engine's fleet
    first = next_version(fleet.controller)         # 1 on a fleet that never updated
"""

from __future__ import annotations

from typing import Any


def check_fleet(fleet: Any, engine: str, command: str) -> None:
    """ValueError unless ``fleet`` runs ``engine`` (the bench's client and checks are
    chosen by ``engine``)."""
    if fleet.engine != engine:
        raise ValueError(f"{command}: fleet= runs engine {fleet.engine!r}, not {engine!r}; "
                         f"pass engine={fleet.engine!r}")


def next_version(ctl: Any) -> int:
    """One above every version ``ctl`` attempted or one of its replicas holds."""
    held = [v for v in ctl.weights_version().values() if v is not None]
    return 1 + max([ctl.state.attempted or 0, *held])
