"""Core library: data plane, layouts, quantization and the trainer pipeline.

Nothing in this package imports Ray; ``actors`` wraps it for a Ray cluster.
"""

__version__ = "0.2.0"
