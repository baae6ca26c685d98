"""The plan as the executor runs it: checks and checked decoding of plan blobs."""
