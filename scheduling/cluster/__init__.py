"""Cluster descriptions: written YAML, defaults derived from the actors, and the topology."""
