"""The authenticated TCP transport: one-sided writes over sockets, for hosts without RDMA.

``transport.py`` is the backend; ``client.py`` the writer's side; ``server.py`` and
``target.py`` the listener and the memory it writes into; ``wire.py`` and ``codec.py`` the
frames, their sealing and compression.
"""
