"""The ``wt`` command line (:mod:`actors.cli.main`): typer commands, rich tables and
progress (:mod:`~actors.cli.progress`), and the plots they draw. Commands import Ray and
the actors lazily, inside the command, so ``wt plan`` and ``wt simulate`` stay pure.
"""
