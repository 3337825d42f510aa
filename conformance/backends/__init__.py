"""Built-in backends: ``spec`` (the spec itself, a self-check) and ``torch`` (eager PyTorch in bf16/fp16)."""
