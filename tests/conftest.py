"""Shared fixtures: simulated NICs and remote target processes that clean up after a test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from testkit.harness import RemoteTarget
from weight_transfer.transport.simnic import SimNic


@pytest.fixture
def make_simnic() -> Iterator[Callable[..., SimNic]]:
    """Build SimNic objects (keywords as for SimNic); all are closed after the test."""
    nics: list[SimNic] = []

    def make(**kwargs: Any) -> SimNic:
        kwargs.setdefault("owner", f"proc{len(nics)}")
        nic = SimNic(**kwargs)
        nics.append(nic)
        return nic

    yield make
    for nic in nics:
        nic.close()


@pytest.fixture
def make_target() -> Iterator[Callable[..., RemoteTarget]]:
    """Start RemoteTarget processes (arguments as for RemoteTarget); all are closed after."""
    targets: list[RemoteTarget] = []

    def make(*args: Any, **kwargs: Any) -> RemoteTarget:
        target = RemoteTarget(*args, **kwargs)
        target.start()
        targets.append(target)
        return target

    yield make
    for target in targets:
        target.close()
