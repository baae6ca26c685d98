"""Replica groups: replicas that share a site get one copy from the trainers, the rest from a peer.

TensorHub's cross-datacenter case: the replicas of a remote site sit behind a
slow link. ``TransferConfig.replica_groups`` lists the replicas of each site
(``[["engine0", "engine1"], ["engine2", "engine3"]]``); per group, the first
replica the controller holds is the group's *leader*: the plan writes it from
the trainers, and after the trainers' writes every other member (a
*follower*, paused like every replica) is filled from the leader by the peer
copy of :meth:`~actors.controller.replicas.ReplicaOps.resync` (``wt_copy_to``:
rank r to rank r, engine to engine, inside the site), all pairs at once; then
followers resume with the version like the leader. So the slow link carries
one copy per group instead of one per replica. A follower whose leader is torn
(missed bytes, did not pause) or whose copy fails is torn itself (held paused,
re-filled by ``auto_resync`` from a replica that holds the version). Replicas
in no group are written by the trainers as before::

    groups = ReplicaGroups.parse([["engine0", "engine1"], ["engine2"]])
    groups.followers(["engine0", "engine1", "engine2"])   # {"engine1": "engine0"}
    groups.planned(["engine0", "engine1", "engine2"])     # ["engine0", "engine2"]

This module is the pure part (no Ray); the copies are :mod:`actors.controller.groups`'.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from weight_transfer.config_files import FieldError


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaGroups:
    """Which replicas share a site; see the module docstring."""

    groups: tuple[tuple[str, ...], ...] = ()

    @classmethod
    def parse(cls, value: Any, *, where: str = "replica_groups") -> ReplicaGroups:
        """From a list of lists of replica names; ValueError naming ``where`` and the entry
        (a FieldError: inside a model's validator, the model's location goes in front)."""
        if isinstance(value, ReplicaGroups):
            return value
        if value is None:
            return cls()
        if isinstance(value, str | bytes) or not isinstance(value, Iterable):
            raise FieldError(f"{where}: a list of groups (lists of replica names), "
                             f"not {value!r:.60}")
        seen: dict[str, int] = {}
        groups = []
        for i, group in enumerate(value):
            if isinstance(group, str | bytes) or not isinstance(group, Iterable):
                raise FieldError(f"{where}[{i}]: a list of replica names, not {group!r:.60}")
            names = tuple(group)
            if not names:
                raise FieldError(f"{where}[{i}]: an empty group")
            for name in names:
                if not isinstance(name, str) or not name:
                    raise FieldError(f"{where}[{i}]: replica names are strings, not {name!r}")
                if name in seen:
                    raise FieldError(f"{where}: replica {name!r} is in groups {seen[name]} "
                                     f"and {i}; a replica belongs to one group")
                seen[name] = i
            groups.append(names)
        return cls(groups=tuple(groups))

    def __bool__(self) -> bool:
        return any(len(g) > 1 for g in self.groups)

    def followers(self, present: Iterable[str]) -> dict[str, str]:
        """``{follower: its leader}`` among the replicas ``present`` (a group's leader is
        its first member present; a group with one member present has no follower)."""
        here = set(present)
        out = {}
        for group in self.groups:
            members = [n for n in group if n in here]
            out.update({f: members[0] for f in members[1:]})
        return out

    def planned(self, present: Sequence[str]) -> list[str]:
        """The replicas the trainers write (``present`` in order, followers left out)."""
        followers = self.followers(present)
        return [n for n in present if n not in followers]

    def site_of(self, name: str) -> int | None:
        """The index of the group holding replica ``name``, or None."""
        return next((i for i, g in enumerate(self.groups) if name in g), None)
