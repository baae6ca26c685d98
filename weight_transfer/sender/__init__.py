"""The trainer side of an update: the executor, its pipeline, prepare, gather and staging.

``delta/`` holds the sender of sparse delta updates.
"""
