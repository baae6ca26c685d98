"""An engine rank's delta arena follows its memory's NIC: after the memory is registered
again (the shadow in place of live memory closes the old NICs), the next
``wt_delta_arena`` registers a new arena on the new NIC instead of handing back a region
that died with the old one (trainers' writes into it failed "no live region with rkey")."""

from __future__ import annotations

from types import SimpleNamespace

from weight_transfer.engines.delta_rank import DeltaRankMixin


class FakeNic:
    def __init__(self, name: str) -> None:
        self.name, self.live, self.closed, self.made = name, set(), False, 0

    def register(self, buffer) -> tuple[str, int]:
        self.made += 1
        region = (self.name, self.made)
        self.live.add(region)
        return region

    def deregister(self, region) -> None:
        assert not self.closed, f"deregister on closed {self.name}"
        self.live.remove(region)


class Rank(DeltaRankMixin):
    def __init__(self, nic: FakeNic) -> None:
        self.use(nic)

    def use(self, nic: FakeNic) -> None:
        self._wt_mem = SimpleNamespace(owner="engine0/tp0", nics={"nic0": nic},
                                       meta=SimpleNamespace(nic="nic0"))


SLOTS = {0: (0, 64), 1: (64, 64)}


def test_the_same_slots_on_the_same_nic_reuse_the_region() -> None:
    nic = FakeNic("a")
    rank = Rank(nic)
    first = rank.wt_delta_arena(SLOTS)
    assert rank.wt_delta_arena(SLOTS) == first and nic.live == {first}


def test_new_slots_replace_the_region_on_the_same_nic() -> None:
    nic = FakeNic("a")
    rank = Rank(nic)
    first = rank.wt_delta_arena(SLOTS)
    second = rank.wt_delta_arena({0: (0, 128)})
    assert nic.live == {second} and first not in nic.live


def test_memory_registered_again_on_a_new_nic_gets_a_new_arena() -> None:
    old, new = FakeNic("old"), FakeNic("new")
    rank = Rank(old)
    rank.wt_delta_arena(SLOTS)
    old.closed = True  # the memory closed its NICs and registered on new ones
    rank.use(new)
    region = rank.wt_delta_arena(SLOTS)
    assert region[0] == "new" and new.live == {region}
