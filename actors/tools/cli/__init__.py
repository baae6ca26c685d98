"""The ``wt`` command line (:mod:`actors.tools.cli.main`): typer commands, rich tables and
progress (:mod:`~actors.tools.cli.progress`), and the plots they draw. Commands import Ray and
the actors lazily, inside the command, so ``wt plan`` and ``wt simulate`` stay pure.
"""
