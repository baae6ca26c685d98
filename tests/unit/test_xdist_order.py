"""The suite's module order on xdist workers (tests/xdist_order.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import xdist_order
from xdist_order import (  # tests/ is on sys.path: the folder of tests/conftest.py
    GROUPS,
    CostFirstScheduling,
    group_order,
    load_module_seconds,
    merge_module_seconds,
    module_seconds,
    save_module_seconds,
)


class Worker:
    """What the scheduler sees of an xdist worker: the test indices sent to it."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


COLLECTION = (
    [f"tests/unit/test_many.py::test_{i}" for i in range(5)]
    + ["tests/integration/test_heavy.py::test_a",
       "tests/integration/test_medium.py::test_a", "tests/integration/test_medium.py::test_b",
       "tests/integration/test_medium.py::test_c",
       "tests/integration/test_new.py::test_a",
       "tests/integration/test_big.py::test_a", "tests/integration/test_big.py::test_b"])
SECONDS = {"tests/unit/test_many.py": 2.0, "tests/integration/test_heavy.py": 100.0,
           "tests/integration/test_medium.py": 20.0, "tests/integration/test_big.py": 80.0}


def start(seconds: dict[str, float], workers: int = 2, heavy_slots: int | None = None,
          ) -> tuple[CostFirstScheduling, ...]:
    config = SimpleNamespace(getvalue=lambda name: {"tx": [f"{workers}*popen"]}[name],
                             option=SimpleNamespace(loadscopereorder=True))
    sched = CostFirstScheduling(config, seconds=seconds, heavy_slots=heavy_slots)
    nodes = [Worker(f"gw{i}") for i in range(workers)]
    for worker in nodes:
        sched.add_node(worker)
        sched.add_node_collection(worker, COLLECTION)
    sched.schedule()
    return (sched, *nodes)


def modules(worker: Worker) -> list[str]:
    out: list[str] = []
    for index in worker.sent:
        module = COLLECTION[index].split("::")[0].rsplit("/", 1)[1]
        if not out or out[-1] != module:
            out.append(module)
    return out


def test_unmeasured_then_costliest_first_one_test_held_back() -> None:
    sched, one, two = start(SECONDS)
    # The unmeasured module first, then the costliest. Each holds a single test, which
    # its worker runs only once it knows the next: each gets its next module at once.
    assert modules(one) == ["test_new.py", "test_big.py"]
    assert modules(two) == ["test_heavy.py", "test_medium.py"]
    # gw1 finishes test_heavy: test_medium's three tests are pending, nothing more is sent
    sched.mark_test_complete(two, COLLECTION.index("tests/integration/test_heavy.py::test_a"))
    assert modules(two) == ["test_heavy.py", "test_medium.py"]
    sched.mark_test_complete(two, COLLECTION.index("tests/integration/test_medium.py::test_a"))
    assert modules(two) == ["test_heavy.py", "test_medium.py"]
    # one test of test_medium left (the one held): the next module goes to gw1
    sched.mark_test_complete(two, COLLECTION.index("tests/integration/test_medium.py::test_b"))
    assert modules(two) == ["test_heavy.py", "test_medium.py", "test_many.py"]
    assert not sched.workqueue
    # the queue is empty: the next worker asking for work is told to stop
    sched.mark_test_complete(one, COLLECTION.index("tests/integration/test_new.py::test_a"))
    assert one.shutting_down and not two.shutting_down
    assert sorted(one.sent + two.sent) == list(range(len(COLLECTION)))  # each test sent once


def test_without_a_table_ties_keep_xdists_order() -> None:
    _, one, two = start({})
    # every module unmeasured: xdist's own order (most tests first) decides
    assert modules(one)[0] == "test_many.py"
    assert modules(two)[0] == "test_medium.py"


def test_workers_beyond_the_heavy_slots_run_the_light_modules_then_stop() -> None:
    seconds = {**SECONDS, "tests/integration/test_new.py": 1.0}  # light
    sched, one, two, three = start(seconds, workers=3, heavy_slots=1)
    # one heavy module at a time; the other workers take the light ones, costliest first
    assert modules(one)[0] == "test_heavy.py"
    assert modules(two) == ["test_many.py"]
    # test_new holds its single test: its worker asks for more at once, finds the slot
    # taken and no light module left, and is told to stop with heavy modules still queued
    assert modules(three) == ["test_new.py"] and three.shutting_down
    assert modules(one) == ["test_heavy.py", "test_big.py"]  # heavy after heavy, in turn
    assert list(sched.workqueue) == ["tests/integration/test_medium.py"]
    for i in range(4):
        sched.mark_test_complete(two, COLLECTION.index(f"tests/unit/test_many.py::test_{i}"))
    assert two.shutting_down and modules(two) == ["test_many.py"]
    sched.mark_test_complete(one, COLLECTION.index("tests/integration/test_heavy.py::test_a"))
    sched.mark_test_complete(one, COLLECTION.index("tests/integration/test_big.py::test_a"))
    assert modules(one) == ["test_heavy.py", "test_big.py", "test_medium.py"]
    assert sorted(one.sent + two.sent + three.sent) == list(range(len(COLLECTION)))


def test_table_round_trip_and_merge(tmp_path) -> None:
    path = tmp_path / "module_seconds.json"
    assert load_module_seconds(path) == {}
    run = module_seconds([("tests/a.py::t1", 1.25), ("tests/a.py::t1", 0.5),
                          ("tests/a.py::t2[x]", 2.0), ("tests/b.py::C::t", 3.0)])
    assert run == {"tests/a.py": 3.75, "tests/b.py": 3.0}
    old = {"tests/a.py": 9.0, "tests/gone.py": 5.0, "tests/c.py": 7.0}
    merged = merge_module_seconds(old, run, ["tests/a.py", "tests/b.py", "tests/c.py"])
    assert merged == {"tests/a.py": 3.75, "tests/b.py": 3.0, "tests/c.py": 7.0}
    save_module_seconds(path, merged)
    assert load_module_seconds(path) == {"tests/a.py": 3.8, "tests/b.py": 3.0, "tests/c.py": 7.0}
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("text, why", [
    ("not json", "not a module-seconds table"),
    (json.dumps({"format": 2, "modules": {}}), "format 2, expected 1"),
    (json.dumps({"format": 1, "modules": []}), "'modules' is not a mapping"),
    (json.dumps({"format": 1, "modules": {"tests/a.py": "x"}}), "not a module-seconds table"),
    (json.dumps({"format": 1, "modules": {"tests/a.py": -1}}), "['tests/a.py']"),
])
def test_a_bad_table_is_refused_naming_the_file(tmp_path, text, why) -> None:
    path = tmp_path / "module_seconds.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"module_seconds\.json") as err:
        load_module_seconds(path)
    assert why in str(err.value)


def test_the_checked_in_table_loads_and_names_existing_modules() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    table = load_module_seconds(root / "tests" / "module_seconds.json")
    assert table, "tests/module_seconds.json is missing or empty"
    missing = [m for m in table if not (root / m).is_file()]
    assert not missing, f"rows for modules that do not exist: {missing}"


def test_a_group_runs_together_in_its_order_where_its_first_module_was(monkeypatch) -> None:
    group = ("tests/integration/test_medium.py", "tests/integration/test_heavy.py")
    monkeypatch.setattr(xdist_order, "GROUPS", {"pair": group})
    monkeypatch.setattr(xdist_order, "_GROUP_OF", dict.fromkeys(group, "pair"))
    ordered = [COLLECTION[i] for i in group_order(list(COLLECTION))]
    assert sorted(ordered) == sorted(COLLECTION)
    assert [n.split("::")[0].rsplit("/", 1)[1] for n in ordered[4:10]] == [
        "test_many.py", "test_medium.py", "test_medium.py", "test_medium.py",
        "test_heavy.py", "test_new.py"]
    # one unit of work, its seconds summed (120: before test_big's 80), on one worker
    sched = CostFirstScheduling(
        SimpleNamespace(getvalue=lambda name: {"tx": ["2*popen"]}[name],
                        option=SimpleNamespace(loadscopereorder=True)), seconds=SECONDS)
    nodes = [Worker("gw0"), Worker("gw1")]
    for worker in nodes:
        sched.add_node(worker)
        sched.add_node_collection(worker, ordered)
    sched.schedule()
    assert sched.cost("pair") == 120.0
    sent = [[ordered[i].split("::")[0].rsplit("/", 1)[1] for i in w.sent] for w in nodes]
    assert sent[1][:4] == ["test_medium.py"] * 3 + ["test_heavy.py"]  # the group, in order
    assert "test_heavy.py" not in sent[0] and "test_medium.py" not in sent[0]


def test_the_groups_name_existing_modules_each_in_one_group() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    members = [m for modules in GROUPS.values() for m in modules]
    assert len(members) == len(set(members))
    assert [m for m in members if not (root / m).is_file()] == []
