"""``mlaspec check`` while it runs: a bar on a terminal's stderr naming the case in flight (still there when the
process dies), no bar and a few count lines in a log, the same stdout lines either way."""

import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

from mlaspec.conformance.cases import curated_cases
from mlaspec.conformance.cli import main
from mlaspec.conformance.progress import Progress
from mlaspec.conformance.verdict import Result

TESTS = Path(__file__).resolve().parent
CASES = curated_cases(ops=("attention",), dtypes=("float32",))


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _result(case, verdict: str) -> Result:
    return Result(case.id, case.op, case.dtype, verdict, repro=f"rerun {case.id}")


def _run(progress: Progress, verdicts: list[str], announced_cases=CASES) -> None:
    for i, (case, verdict) in enumerate(zip(announced_cases, verdicts)):
        progress.before(i, case)
        progress.after(i, _result(case, verdict))


def test_a_log_gets_no_bar_and_a_count_line_every_tenth_of_the_run():
    n = 60  # every 25 cases (a tenth is 6, fewer than FEWEST_BETWEEN_COUNTS): counts after 25 and 50
    cases = (CASES * n)[:n]
    out, err = io.StringIO(), io.StringIO()
    with Progress(n, announced=n, repro=lambda c: f"rerun {c.id}", out=out, err=err) as progress:
        _run(progress, ["pass"] * 10 + ["fail"] + ["skip"] * 49, cases)
    lines = out.getvalue().splitlines()
    assert err.getvalue() == "" and "\r" not in out.getvalue()
    assert lines == [
        f"[ 11/60] FAIL  {cases[10].id}",
        "[ 25/60] 10 passed, 1 failed, 0 errors, 14 skipped",
        "[ 50/60] 10 passed, 1 failed, 0 errors, 39 skipped",
    ]


def test_a_terminal_gets_a_bar_on_stderr_and_the_same_lines_on_stdout():
    n = len(CASES)
    verdicts = ["pass", "error"] + ["pass"] * (n - 2)
    logged, shown = io.StringIO(), io.StringIO()
    with Progress(n, announced=n - 1, repro=lambda c: f"rerun {c.id}", out=logged, err=io.StringIO()) as progress:
        _run(progress, verdicts)
    with Progress(n, announced=n - 1, repro=lambda c: f"rerun {c.id}", out=shown, err=Terminal()) as progress:
        _run(progress, verdicts)
        bar = progress.bar.fp.getvalue()
    last = f"[{n:>3}/{n}]"
    lines = [f"[  2/{n}] ERROR {CASES[1].id}", f"{last} RUN   rerun {CASES[-1].id}", f"{last} PASS  {CASES[-1].id}"]
    assert shown.getvalue().splitlines() == logged.getvalue().splitlines() == lines
    assert f"0/{n}" in bar and "case/s" in bar and "1 failed" in bar and "\r" in bar


def test_the_bar_names_the_case_in_flight_before_it_runs():
    """A process that dies in a case leaves the bar as it last drew it: with that case's id."""
    err = Terminal()
    progress = Progress(len(CASES), announced=len(CASES), repro=str, out=io.StringIO(), err=err)
    _run(progress, ["pass", "pass"])
    progress.before(2, CASES[2])  # ... and the process dies here
    assert err.getvalue().rsplit("\r", 1)[-1].startswith(CASES[2].id)


def test_check_under_capture_draws_no_bar(tmp_path, capsys):
    assert main(["check", "--backend", "spec", "--ops", "merge_attn_states", "--report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "\r" not in captured.out and "passed" in captured.out


def _check_on(stderr_is_a_terminal: bool, tmp_path: Path, *argv: str) -> tuple[int, str, str]:
    """``mlaspec check`` in a process of its own, its stderr a pseudo-terminal or a pipe: status, stdout, stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONFAULTHANDLER", None)  # its traceback would follow the bar
    command = [sys.executable, "-m", "mlaspec.conformance.cli", "check", "--report", str(tmp_path), *argv]
    if not stderr_is_a_terminal:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        return done.returncode, done.stdout, done.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty is 0 columns wide
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=follower, text=True) as process:
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the process closed its end
                break
            if not chunk:
                break
            chunks.append(chunk)
        out = process.stdout.read()
    os.close(leader)
    return process.returncode, out, b"".join(chunks).decode(errors="replace")


def test_a_crash_leaves_the_case_id_on_the_terminal_and_no_bar_in_a_log(tmp_path):
    """In this process (``--isolation none``) a segfault in ``attention[gqa-noncausal-float32]`` takes the run down:
    on a terminal the bar's last drawing names it; with stderr a pipe nothing on stderr is a bar."""
    argv = ("--backend", "misbehaving:Segfault", "--isolation", "none", "--ops", "attention", "--dtypes", "float32")
    status, out, err = _check_on(True, tmp_path / "tty", *argv)
    assert status == -11, (status, out, err)
    assert "case/s" in err and "|" in err, err
    assert err.rsplit("\r", 1)[-1].startswith("attention[gqa-noncausal-float32]"), err
    status, out, err = _check_on(False, tmp_path / "log", *argv)
    assert status == -11 and "\r" not in err and "case/s" not in err and "\r" not in out, (status, out, err)
