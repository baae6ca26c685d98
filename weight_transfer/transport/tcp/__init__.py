"""The authenticated TCP transport: one-sided writes over sockets, for hosts without RDMA.

``transport.py`` is the backend; ``client.py`` the writer's side; ``gate.py`` the
listener's event-driven handshakes (also the barrier store's), ``server.py`` and ``target.py``
the sessions and the memory they write into; ``wire.py`` and ``codec.py`` the frames, their
sealing and compression.
"""
