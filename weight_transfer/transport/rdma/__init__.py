"""Real RDMA WRITE through pyverbs: RC queue pairs, memory regions, CQ polling.

``transport.py`` is the backend; ``verbs.py`` the pyverbs objects; ``wire.py`` and
``plan.py`` the work requests; ``window.py`` the outstanding-write window; ``cuda.py``
GPU memory through dma-buf; ``errors.py`` completion errors mapped to exceptions.
"""
