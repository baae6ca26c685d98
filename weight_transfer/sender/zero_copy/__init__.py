"""Zero-copy sources: trainer memory registered once and written from directly
(:mod:`.sources`), and the fence that keeps the optimizer step off it until the
writes complete (:mod:`.fence`)."""
