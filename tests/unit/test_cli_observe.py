"""The command line's side of observability: ``wt trace``, ``--json -``, progress bars."""

from __future__ import annotations

import io
import json
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from actors.tools.cli.main import app
from actors.tools.cli.progress import PhaseBars, command_console, emit_json, progress_bar, steps
from actors.tools.demo.run_config import ROOT
from weight_transfer.observe.trace import RankTrace, UpdateTrace, write_chrome_trace
from weight_transfer.sender.pipeline import Span

runner = CliRunner()
MODEL = ROOT / "configs" / "models" / "tiny_llama.yaml"
CLUSTER = ROOT / "configs" / "clusters" / "local_cpu.yaml"


def wt(*args: object):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


@pytest.fixture
def trace_file(tmp_path):
    def rank(r):
        spans = (Span(key="a", stage="prepare", start=0.0, end=0.5, nbytes=4),
                 Span(key="a", stage="write", start=0.5, end=0.9, nbytes=4))
        tasks = (Span(key=1, stage="write", start=0.5, end=0.8, nbytes=4),)
        return RankTrace(rank=r, nic=f"nic{r}", clock_offset=100.0, spans=spans,
                         task_spans=tasks)

    ups = [UpdateTrace(version=v, started_at=100.0 + 10 * v, seconds=1.0,
                       ranks=(rank(0), rank(1)), nic_bound_seconds=0.3) for v in (1, 2)]
    return write_chrome_trace(tmp_path / "t.json", ups)


def test_wt_trace_draws_every_update_or_one(trace_file, tmp_path):
    pytest.importorskip("matplotlib", reason="the plots extra is not installed")
    out = tmp_path / "t.png"
    r = wt("trace", trace_file, "--png", out)
    assert r.exit_code == 0, r.output
    assert "update v1" in r.output and "update v2" in r.output
    assert out.read_bytes()[:4] == b"\x89PNG"
    r = wt("trace", trace_file, "--version", "2")
    assert r.exit_code == 0 and "update v1" not in r.output and "perfetto" in r.output


def test_wt_trace_refuses_what_is_not_a_trace(tmp_path, trace_file):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    r = wt("trace", bad, "--png", tmp_path / "x.png")
    assert r.exit_code == 2 and "not a weight-transfer trace" in " ".join(r.output.split())
    r = wt("trace", trace_file, "--version", "7")
    assert r.exit_code == 2 and "no update 7" in r.output


def test_pngs_without_matplotlib_exit_2_naming_the_extra(trace_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for args in (("trace", trace_file, "--png", tmp_path / "a.png"),
                 ("simulate", "--model", MODEL, "--cluster", CLUSTER, "--png",
                  tmp_path / "b.png")):
        r = wt(*args)
        assert r.exit_code == 2, r.output
        assert "`plots` extra" in " ".join(r.output.split())


def test_json_to_stdout_keeps_stdout_pure_json():
    r = wt("plan", "--model", MODEL, "--cluster", CLUSTER, "--json", "-")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)  # nothing else on stdout
    assert doc["tasks"] > 0 and doc["model"] == "tiny-llama"
    assert "NIC lower bound" in r.stderr  # the table went to stderr


def test_simulate_png_and_json(tmp_path):
    pytest.importorskip("matplotlib", reason="the plots extra is not installed")
    png = tmp_path / "sim.png"
    r = wt("simulate", "--model", MODEL, "--cluster", CLUSTER, "--png", png, "--json", "-")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["predicted_s"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bars_only_on_a_terminal_and_never_when_quiet():
    log = Console(file=io.StringIO())
    term = Console(file=io.StringIO(), force_terminal=True)
    assert progress_bar(log).disable
    assert not progress_bar(term).disable
    assert progress_bar(term, quiet=True).disable
    with progress_bar(term) as bar:
        hook = PhaseBars(bar)
        hook("gather", 0, 4)
        hook("gather", 4, 4)
        (task,) = bar.tasks
        assert (task.description, task.completed, task.total) == ("gather", 4, 4)
    with steps(term, "planning", 2) as step:
        step("one")
        step("two")


def test_emit_json_to_stdout_or_a_file(tmp_path, capsys):
    console = command_console("-")
    assert console.stderr
    emit_json("-", {"a": 1}, console)
    assert json.loads(capsys.readouterr().out) == {"a": 1}
    emit_json(tmp_path / "sub" / "x.json", {"b": 2}, command_console())
    assert json.loads((tmp_path / "sub" / "x.json").read_text()) == {"b": 2}
