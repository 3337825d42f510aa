"""The conformance suite as pytest tests: ``pytest --pyargs mlaspec.conformance --mla-backend NAME``.

``test_curated`` runs the curated cases of ``mlaspec check`` (the same list, ids = case ids, one marker per op);
``test_generated`` lets hypothesis draw further cases of each op and shrinks a failure to a minimal one. The
fixtures and options come from :mod:`mlaspec.conformance.plugin`.
"""

from mlaspec.conformance.plugin import generate_tests


def pytest_generate_tests(metafunc):
    generate_tests(metafunc)


def test_curated(mla_case, mla_check):
    mla_check(mla_case)


def test_generated(mla_op, mla_check_generated):
    mla_check_generated(mla_op)
