"""The library's errors cross a real Ray actor call with their type and typed fields: what
an actor raises reaches the caller as an instance of the same class."""

from __future__ import annotations

import pytest
import ray

from weight_transfer.errors import BarrierTimeoutError, FaultKind, UpdateError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@ray.remote
class Raiser:
    def update_error(self) -> None:
        raise UpdateError("update to version 5 failed on replicas ['engine1']", version=5,
                          ranks={0: "did not finish"}, torn=["engine1"],
                          rank_kinds={0: FaultKind.TIMEOUT},
                          replica_kinds={"engine1": (FaultKind.UNRESPONSIVE,)})

    def barrier_error(self) -> None:
        raise BarrierTimeoutError("barrier wt/v5/g0: ranks [1] of [0, 1] did not arrive",
                                  barrier="wt/v5/g0", missing=[1], timeout_s=2.0)


@pytest.fixture(scope="module")
def raiser(ray_job):  # on the shared cluster
    return Raiser.remote()


def test_an_update_error_raised_in_an_actor_keeps_its_class_and_fields(raiser):
    with pytest.raises(UpdateError) as info:
        ray.get(raiser.update_error.remote())
    err = info.value
    cause = err.cause if isinstance(err, ray.exceptions.RayTaskError) else err
    for e in (err, cause):
        assert e.version == 5 and e.torn == ["engine1"] and e.ranks == {0: "did not finish"}
        assert e.rank_kinds == {0: FaultKind.TIMEOUT}
        assert e.replica_kinds == {"engine1": (FaultKind.UNRESPONSIVE,)}
    assert type(cause) is UpdateError and "version 5 failed" in str(cause)


def test_a_barrier_timeout_raised_in_an_actor_is_still_a_timeout_error(raiser):
    with pytest.raises(TimeoutError) as info:
        ray.get(raiser.barrier_error.remote())
    assert isinstance(info.value, BarrierTimeoutError)
    assert info.value.missing == (1,) and info.value.barrier == "wt/v5/g0"
