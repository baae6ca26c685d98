"""Synchronisation: barriers, listening addresses and weight versions."""
