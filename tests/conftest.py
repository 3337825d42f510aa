"""Hypothesis profiles: ``dev`` (default, quick), ``ci`` (deterministic and bounded), ``thorough`` (nightly).

Pick one with ``HYPOTHESIS_PROFILE=ci`` or pytest's ``--hypothesis-profile ci``.
"""

import os

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
