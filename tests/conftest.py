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

import pytest
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


# `pytest -m "not slow"`: a contributor's quick run. The slow set is whole files that run kernels through the Triton
# interpreter, drive a backend through every curated case (the mutation corpus, the sensitivity probes, isolation's
# worker processes, DCP's rank processes, the plugin's pytest-in-pytest) or open a browser. CI runs everything.
SLOW_FILES = frozenset(
    {
        "test_distributed.py",
        "test_docs_offline.py",
        "test_impl_dcp.py",
        "test_impl_indexer.py",
        "test_impl_interpreter.py",
        "test_impl_layer.py",
        "test_impl_ops.py",
        "test_impl_serving.py",
        "test_impl_sparse.py",
        "test_isolation.py",
        "test_mutants_dcp.py",
        "test_mutants_dense.py",
        "test_mutants_serving.py",
        "test_mutants_sparse.py",
        "test_plugin.py",
        "test_report_browser.py",
        "test_sensitivity.py",
    }
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


# The reference cache (mlaspec.conformance.references) of every test run, and of the processes it starts, lives in a
# fresh directory: never the user's ~/.cache/mlaspec, never a stale one.
if "MLASPEC_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["MLASPEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="mlaspec-test-cache-")
    atexit.register(shutil.rmtree, os.environ["MLASPEC_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def spawned(monkeypatch):
    """Every worker process :func:`mlaspec.conformance.spawn.spawn` starts from now on, as a list (under both names
    of it: the CLI's and the plugin's, and :class:`~mlaspec.conformance.worker.WorkerBackend`'s own)."""
    from mlaspec.conformance import spawn as spawning
    from mlaspec.conformance import worker

    real, started = spawning.spawn, []

    def recording(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(spawning, "spawn", recording)
    monkeypatch.setattr(worker, "spawn", recording)
    return started
