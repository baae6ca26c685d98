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
        elif current is not None and (item := re.match(r"- `(\w+)`$", line)):
            current.append(item.group(1))
    return out


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
