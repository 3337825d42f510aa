"""Starting a backend's worker process (:mod:`mlaspec.conformance.worker`), without importing torch.

``mlaspec check`` starts its worker first thing, before its own imports: the worker's start (torch, the backend,
for a GPU its CUDA context) then runs beside the parent's (torch, the ops, the case list) instead of after them,
~1.6 s of each on 2 cores, a tenth of the default run (:func:`mlaspec.conformance.cli.main`).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

__all__ = ["Spawned", "spawn"]


@dataclass
class Spawned:
    """A worker process just started: ``proc``, the parent's end ``conn`` of its connection, its output ``log``."""

    backend_name: str
    proc: subprocess.Popen
    conn: Connection
    log: Path

    def kill(self) -> None:
        """End it, if it still runs (a run that stopped before it was used); again or after the worker stopped:
        nothing."""
        self.conn.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def spawn(backend_name: str, log: Path | None = None) -> Spawned:
    """Start ``python -m mlaspec.conformance.worker`` for ``backend_name``, its stdout and stderr going to ``log``
    (default: a new file in a temporary folder). It loads the backend and then says ``ready`` on the connection."""
    if log is None:
        log = Path(tempfile.mkdtemp(prefix="mlaspec-worker-")) / "worker.log"
    conn, child = Pipe(duplex=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlaspec.conformance.worker", str(child.fileno()), backend_name],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=[child.fileno()],
        )
    child.close()
    return Spawned(backend_name, proc, conn, log)
