"""The controller: gather metadata, plan once, run each update, keep replicas and versions.

``controller.py`` holds :class:`WeightTransferController`; ``state.py`` its explicit state;
``setup.py`` the one-time set-up; ``update.py`` the update algorithm, its steps written once,
and ``strategies.py`` how they reach the engines (in place or shadow, and rollback);
``replicas.py`` and ``groups.py`` replicas and replica groups; ``checks.py`` and ``served.py``
the integrity checks; ``engine_control.py`` pause, resume and fencing of engines;
``calls.py`` waits on actors; ``audit.py`` the audit log, metrics and traces.
"""
