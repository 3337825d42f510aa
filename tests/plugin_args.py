"""The arguments that start the harness's pytest front end in a test: ``SUITE`` loads the plugin and collects the
conformance suite. Installed (``pip install -e .``), the plugin loads through its ``pytest11`` entry point and ``-p``
would register it twice; run from the tree on ``PYTHONPATH`` alone (a GPU machine's copy), ``-p`` loads it."""

from importlib.metadata import entry_points

REGISTERED = any(ep.name == "mlaspec" for ep in entry_points(group="pytest11"))
PLUGIN = [] if REGISTERED else ["-p", "mlaspec.conformance.plugin"]
SUITE = [*PLUGIN, "-p", "no:cacheprovider", "--pyargs", "mlaspec.conformance"]
