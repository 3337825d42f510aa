"""Hypothesis profiles: ``dev`` (default, quick), ``ci`` (deterministic and bounded), ``thorough`` (nightly).

Pick one with ``HYPOTHESIS_PROFILE=ci`` or pytest's ``--hypothesis-profile ci``.
"""

import os

# Triton kernels are tested through the interpreter where there is no GPU (CI). Triton fixes interpreted vs
# compiled when a @triton.jit function is defined, so this must hold before any test imports mlaspec.impl.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile(
    "ci",
    max_examples=30,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
