"""Ready-made Ray actors and launch helpers: ``TrainerActor``, ``InferenceActor``, placement.

A user with actors of their own needs none of this: the mixins in :mod:`actors.trainer` and
:mod:`actors.inference` are the library; these are complete actors built on them.
"""
