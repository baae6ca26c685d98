"""Rich progress bars for the command line, and the console they draw on.

Every command that makes a person wait (the demo's set-up and updates, ``wt
plan`` at scale, the benchmarks) draws a transient bar, and none at all when
its output is not a terminal (a log, a pipe, ``ray job logs``) or when
``--json -`` sends the JSON document to standard output: then tables and
messages go to standard error and standard output holds the JSON alone::

    console = command_console(json_path)            # stderr when json_path is "-"
    with progress_bar(console, quiet=json_to_stdout(json_path)) as bar:
        task = bar.add_task("planning", total=3)
        bar.advance(task)
    emit_json(json_path, doc, console)               # a file, or stdout for "-"
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

STDOUT = "-"


def json_to_stdout(json_path: str | Path | None) -> bool:
    return json_path is not None and str(json_path) == STDOUT


def command_console(json_path: str | Path | None = None) -> Console:
    """The console for tables and messages: stderr when the JSON goes to stdout; 120
    columns when the output is a log, not a terminal (unless ``COLUMNS`` says)."""
    stderr = json_to_stdout(json_path)
    console = Console(stderr=stderr)
    if console.is_terminal or "COLUMNS" in os.environ:
        return console
    return Console(stderr=stderr, width=120)


def progress_bar(console: Console, *, quiet: bool = False) -> Progress:
    """A transient bar on ``console``; disabled when quiet or not a terminal."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                    transient=True, disable=quiet or not console.is_terminal)


@contextmanager
def steps(console: Console, description: str, total: int, *,
          quiet: bool = False) -> Iterator[Any]:
    """A bar of ``total`` steps; yields ``step(text)``, which names the next step and
    counts the previous one."""
    with progress_bar(console, quiet=quiet) as bar:
        task = bar.add_task(description, total=total)
        started = [False]

        def step(text: str) -> None:
            if started[0]:
                bar.advance(task)
            started[0] = True
            bar.update(task, description=f"{description}: {text}")

        yield step
        bar.update(task, completed=total)


def emit_json(json_path: str | Path | None, doc: Any, console: Console) -> None:
    """Write ``doc`` to ``json_path`` (parents created), or to stdout for ``-``."""
    if json_path is None:
        return
    text = json.dumps(doc, indent=2) + "\n"
    if json_to_stdout(json_path):
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    console.print(f"wrote {path}")


class PhaseBars:
    """One bar per named phase, driven by ``hook(phase, done, total)`` calls (the
    controller's ``progress`` hook has this signature)."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self._tasks: dict[str, Any] = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase not in self._tasks:
            self._tasks[phase] = self.progress.add_task(phase, total=total)
        self.progress.update(self._tasks[phase], completed=done, total=total)
