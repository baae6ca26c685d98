"""Integrity: checksums of written ranges, checks of what an engine serves, signed receipts."""
