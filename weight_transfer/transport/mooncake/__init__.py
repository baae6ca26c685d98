"""The Mooncake TransferEngine backend (optional extra): TCP here, RDMA on clusters.

``transport.py`` is the backend; ``calls.py`` wraps the engine's calls and their errors.
"""
