"""The public API lives in one place: each package's ``__all__`` equals the list in
docs/embedding.md ("The public API"), and every listed name imports."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "embedding.md"


def documented() -> dict[str, list[str]]:
    """Package -> the names its bullet list under "## The public API" gives."""
    text = DOC.read_text().split("## The public API", 1)[1].split("\n## ", 1)[0]
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"`(\w+)`( \(.*\))?:$", line)
        if head:
            current = out.setdefault(head.group(1), [])
        elif current is not None and (item := re.match(r"- `(\w+)`(: \S.*)?$", line)):
            current.append(item.group(1))
    return out


def test_every_public_name_of_actors_is_described():
    text = DOC.read_text().split("## The public API", 1)[1].split("`scheduling`", 1)[0]
    described = set(re.findall(r"^- `(\w+)`: \S", text, flags=re.M))
    import actors

    assert set(actors.__all__) <= described, set(actors.__all__) - described


def test_the_doc_imports_only_the_public_api():
    """Every import from the project in docs/embedding.md is ``from actors import ...`` (or
    ``from scheduling import ...``) of public names: nothing internal is shown to users."""
    bad = []
    for m in re.finditer(r"^\s*from ((?:actors|scheduling|weight_transfer)[\w.]*) import (.+)$",
                         DOC.read_text(), flags=re.M):
        module, names = m.group(1), [n.strip() for n in m.group(2).split(",")]
        package = importlib.import_module(module) if module in ("actors", "scheduling") else None
        if package is None or not set(names) <= set(package.__all__):
            bad.append(m.group(0).strip())
    assert not bad, bad


def test_the_doc_lists_the_packages():
    assert set(documented()) == {"actors", "scheduling"}


@pytest.mark.parametrize("package", ["actors", "scheduling"])
def test_all_equals_the_documented_list(package):
    names = documented()[package]
    module = importlib.import_module(package)
    assert len(names) == len(set(names)), f"{package}: a name is listed twice"
    assert sorted(module.__all__) == sorted(names)


def test_actors_exports_no_internals():
    import actors

    internal = {"InferenceWorker", "TrainerWorker", "PlanSummary", "TrainerRankMeta",
                "ScheduleActor", "Scheduler", "RankReport", "WriteFailure"}
    assert not internal & set(actors.__all__)
    with pytest.raises(AttributeError):
        actors.ScheduleActor  # noqa: B018 (imported from actors.controller.schedule_actor instead)


def test_weight_transfer_exports_nothing_but_its_version():
    import types

    import weight_transfer

    public = {n for n, v in vars(weight_transfer).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public == set() and weight_transfer.__version__


def test_the_changelog_names_the_current_version():
    import tomllib

    root = DOC.parents[1]
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    import weight_transfer

    assert weight_transfer.__version__ == version
    heads = re.findall(r"^## (\d+\.\d+\.\d+)", (root / "CHANGELOG.md").read_text(), flags=re.M)
    assert heads and heads[0] == version, f"CHANGELOG.md's newest is {heads[:1]}, not {version}"


def test_the_0_1_unpacking_of_launch_vllm_engines_fails_saying_what_to_write():
    """0.1.0 returned ``(facades, owners)``; a Launched of two replicas unpacks into two
    names without an error, so the controller refuses one replica given as ``engines``."""
    from actors import Launched, TransferConfig, WeightTransferController
    from actors.ready.handles import ReplicaRanks

    launched = Launched([ReplicaRanks(["r0t0", "r0t1"]), ReplicaRanks(["r1t0", "r1t1"])],
                        what="vLLM engines")
    replicas, owners = launched  # the old line: no error here
    assert list(owners) == ["r1t0", "r1t1"]  # replica 1, silently taken for the owners
    with pytest.raises(TypeError, match=r"launch_vllm_engines returns one Launched handle.*"
                                        r"`replicas = launch_vllm_engines\(\.\.\.\)`"):
        WeightTransferController(trainers=["t0"], engines=replicas, config=TransferConfig())
