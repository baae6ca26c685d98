"""Outsider programs for the security tests: plain Python that holds no secret and
imports nothing of the project (run by path, in a process of their own)."""
