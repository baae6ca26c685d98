"""Models: configs, Hugging Face configs, name tables, one module per architecture (``arch/``)."""
