"""The ``wt`` command line (:mod:`actors.tools.cli.main`): typer commands, rich tables and
progress (:mod:`~actors.tools.cli.progress`), and the plots they draw. Commands import Ray and
the actors lazily, inside the command, so ``wt plan`` and ``wt simulate`` stay pure.

typer and rich are the ``cli`` extra (``pip install 'weight-transfer[cli]'``): the library
does not need them, and the console script says so where they are missing.
"""

from __future__ import annotations

import sys

CLI_EXTRA = "pip install 'weight-transfer[cli]'"


def entry() -> None:
    """The ``wt`` console script: the command line, or what to install for it."""
    try:
        import rich  # noqa: F401
        import typer  # noqa: F401
    except ImportError as exc:
        sys.exit(f"wt: the command line needs the cli extra ({exc.name} is missing): "
                 f"{CLI_EXTRA}")
    from actors.tools.cli.main import main as run

    run()
