"""The sender of sparse delta updates: sources, diffs, encoding and the writes of records."""
