"""Sparse delta updates, shared by the sender, the engines and the simulator: codec and policy."""
