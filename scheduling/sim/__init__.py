"""The discrete-event simulator of a plan: stages, gathers, deltas and the timeline."""
