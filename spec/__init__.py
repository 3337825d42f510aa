"""mlaspec.spec: executable specifications of DeepSeek's Multi-head Latent Attention as vLLM serves it.

Pure PyTorch, float64, readable first. Nothing here imports ``mlaspec.impl`` or ``mlaspec.conformance``.
"""
