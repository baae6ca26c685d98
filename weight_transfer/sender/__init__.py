"""The trainer side of an update: the executor, its pipeline, prepare, gather and staging.

``delta/`` holds the sender of sparse delta updates; ``zero_copy/`` the trainer memory
registered as write sources and the fence that keeps the optimizer step off it.
"""
