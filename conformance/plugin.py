"""pytest plugin: the conformance cases as pytest tests, with pytest's selection, sharding and reports.

    pytest --pyargs mlaspec.conformance --mla-backend torch                  # curated + generated cases
    pytest --pyargs mlaspec.conformance --mla-backend mine -m mla_decode     # one op (a marker per op)
    pytest --pyargs mlaspec.conformance --mla-backend mine --mla-report out/ --junitxml out/junit.xml -n 2

The tests (``mlaspec/conformance/test_conformance.py``) are the curated cases of ``mlaspec check`` (the same list,
test ids = case ids) and, per op, hypothesis-generated cases (:mod:`mlaspec.conformance.generated`). A case the
backend declares unsupported is skipped with the backend's reason; a failing case's message carries the reason and
the one-line reproducer.

Options (group ``mlaspec``): ``--mla-backend NAME`` (or ``MLASPEC_BACKEND``), ``--mla-scale tiny|full``,
``--mla-dtypes bfloat16,float16``, ``--mla-report DIR`` (``results.jsonl`` streamed per case and ``report.html``, as
``mlaspec check`` writes them; one ``results-<worker>.jsonl`` per pytest-xdist worker, merged into one report),
``--mla-timeout SECONDS`` (per case), ``--mla-examples N`` and ``--mla-seed S`` (generated cases), ``--mla-dcp N``
(the ``dcp_decode`` and ``dcp_decode_fp8`` cases of ``N_cp = N`` on ``N`` processes,
:mod:`mlaspec.conformance.distributed`), ``--mla-device`` (``cuda`` spreads xdist workers over the visible GPUs: worker
``gwN`` gets ``MLASPEC_DEVICE=cuda:<N % n_gpus>``), ``--mla-reference-device`` and ``--mla-no-cache`` / ini
``mla_cache`` (:mod:`mlaspec.conformance.references`).

The plugin is registered under the ``pytest11`` entry point ``mlaspec``, so it loads in every pytest run where
mlaspec is installed. There it only adds its options: it imports nothing heavy (no torch) and changes nothing
unless a backend is named or the conformance tests are collected; only then does a missing backend become one
usage error that says how to name one (as array-api-tests does with ``ARRAY_API_TESTS_MODULE``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

__all__ = ["ENV_BACKEND", "MISSING_BACKEND", "assert_conforms", "worker_device"]

ENV_BACKEND = "MLASPEC_BACKEND"
DTYPE_NAMES = ("bfloat16", "float16", "float32")
MISSING_BACKEND = (
    "mlaspec conformance: no backend to check. Name one with --mla-backend NAME or the environment variable "
    f"{ENV_BACKEND}=NAME, where NAME is a registered backend ({{names}}) or 'module:attr'; "
    "e.g. pytest --pyargs mlaspec.conformance --mla-backend torch"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mlaspec", "mlaspec conformance (pytest --pyargs mlaspec.conformance)")
    group.addoption(
        "--mla-backend",
        metavar="NAME",
        default=None,
        help=f"backend to check: a registered name or 'module:attr' (default: ${ENV_BACKEND})",
    )
    group.addoption(
        "--mla-scale",
        choices=("tiny", "full"),
        default="tiny",
        help="case sizes: tiny (CPU, seconds) or full (real DeepSeek sizes, for GPUs)",
    )
    group.addoption(
        "--mla-dtypes",
        metavar="LIST",
        default="bfloat16,float16",
        help="comma-separated case dtypes (default: bfloat16,float16)",
    )
    group.addoption(
        "--mla-report",
        metavar="DIR",
        default=None,
        help="write DIR/results.jsonl (streamed per case) and DIR/report.html, as mlaspec check does",
    )
    group.addoption(
        "--mla-timeout",
        metavar="SECONDS",
        type=float,
        default=120.0,
        help="per-case timeout; a case past it fails (default: 120)",
    )
    group.addoption(
        "--mla-examples", metavar="N", type=int, default=20, help="hypothesis-generated cases per op (default: 20)"
    )
    group.addoption(
        "--mla-allow-empty",
        action="store_true",
        help="exit 0 when no conformance case passed (every one skipped), instead of 5 (nothing checked)",
    )
    group.addoption(
        "--mla-isolation",
        choices=("process", "none"),
        default="process",
        help="process (default): the backend runs in a worker process (one per pytest-xdist worker), so a crash, "
        "an exit or a hang fails only its case; none: in the test process",
    )
    group.addoption(
        "--mla-strict-numerics",
        action="store_true",
        help="judge against the exact spec's arithmetic, ignoring the numerics the backend declares "
        "(mlaspec.conformance.numerics)",
    )
    group.addoption(
        "--mla-seed",
        metavar="S",
        type=int,
        default=0,
        help="seed of the generated cases (default: 0): the same seed draws the same cases",
    )
    group.addoption(
        "--mla-dcp",
        metavar="N",
        type=int,
        default=None,
        help="run the dcp_decode and dcp_decode_fp8 cases of N_cp=N on N processes of one torch.distributed group, "
        "combined by real collectives (mlaspec check --dcp N; every other case is skipped)",
    )
    group.addoption(
        "--mla-device",
        metavar="DEVICE",
        default=None,
        help="sets MLASPEC_DEVICE; 'cuda' gives pytest-xdist worker gwN the GPU N %% n_gpus",
    )
    group.addoption(
        "--mla-no-cache",
        action="store_true",
        help="compute every reference afresh and write none to the cache (as the ini option mla_cache = false)",
    )
    group.addoption(
        "--mla-reference-device",
        metavar="DEVICE",
        default="auto",
        help="where the float64 references are computed (default auto: the backend's device when it is CUDA, else cpu)",
    )
    parser.addini(
        "mla_cache",
        type="bool",
        default=True,
        help="keep references and budgets in the disk cache ($MLASPEC_CACHE_DIR, else ~/.cache/mlaspec; default true)",
    )


# -- the session's state --------------------------------------------------------------------------------------------
@dataclass
class _State:
    backend_name: str | None
    scale: str
    dtypes: tuple[str, ...]
    report_dir: Path | None
    timeout: float
    examples: int
    seed: int
    worker: str | None  # pytest-xdist worker id ("gw0"), None in the controller or without xdist
    isolation: str = "process"
    strict_numerics: bool = False
    dcp: int | None = None
    reference_device: str = "auto"
    use_cache: bool = True  # False: --mla-no-cache, or the ini option mla_cache = false
    planned: list[str] = field(default_factory=list)
    cases: list = field(default_factory=list)  # the curated cases collected, in the order they run
    markers_registered: bool = False
    _backend: Any = None
    _load_error: str | None = None
    _started: Any = None  # the worker process start() began, until backend() takes it
    _share: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)  # the parent's threads
    _sink: Any = field(default=None, repr=False)
    _ahead: Any = None  # the fork computing references ahead (conformance.ahead), or None

    @classmethod
    def from_config(cls, config: pytest.Config) -> _State:
        opt = config.getoption
        dtypes = tuple(d.strip() for d in opt("mla_dtypes").split(",") if d.strip())
        bad = [d for d in dtypes if d not in DTYPE_NAMES]
        if bad or not dtypes:
            raise pytest.UsageError(
                f"--mla-dtypes must list some of {', '.join(DTYPE_NAMES)}, got {opt('mla_dtypes')!r}"
            )
        report = opt("mla_report")
        worker = getattr(config, "workerinput", {}).get("workerid") or None
        return cls(
            opt("mla_backend") or os.environ.get(ENV_BACKEND) or None,
            opt("mla_scale"),
            dtypes,
            Path(report) if report else None,
            opt("mla_timeout"),
            opt("mla_examples"),
            opt("mla_seed"),
            worker,
            opt("mla_isolation"),
            opt("mla_strict_numerics"),
            opt("mla_dcp"),
            opt("mla_reference_device"),
            not opt("mla_no_cache") and config.getini("mla_cache"),
        )

    @property
    def figure_dir(self) -> Path | None:
        return None if self.report_dir is None else self.report_dir / "figures"

    def reference_cache(self):
        """The disk cache of references (:class:`~mlaspec.conformance.references.ReferenceCache`), or None."""
        from .references import ReferenceCache

        return ReferenceCache.default() if self.use_cache else None

    def start(self) -> None:
        """Start the backend's worker process now (:mod:`~mlaspec.conformance.spawn`), so that its imports run
        beside the rest of pytest's start; :meth:`backend` takes it."""
        if self.isolation == "process" and self.dcp is None and self._backend is None and self._started is None:
            from .spawn import spawn

            self._started = spawn(self.backend_name)
            self._share_cpus()

    def _share_cpus(self) -> None:
        """Take this process's share of the CPUs (:func:`~mlaspec.conformance.cpus.parent_share`) until :meth:`close`:
        the worker or the DCP group's ranks take the rest; under pytest-xdist each of its workers is such a parent."""
        from .cpus import parent_share

        self._share.enter_context(parent_share(runs=int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)))

    def backend(self):
        """The backend object, loaded once; a backend that cannot load fails every test with the same reason."""
        __tracebackhide__ = True
        if self._backend is None and self._load_error is None:
            from .backend import load_backend
            from .worker import WorkerBackend

            started, self._started = self._started, None
            try:
                if self.dcp is not None:
                    from .distributed import RankGroup

                    if self.dcp < 2 or self.isolation != "process":
                        raise ValueError("--mla-dcp needs N >= 2 and --mla-isolation process")
                    self._backend = RankGroup(self.backend_name, self.dcp, timeout=self.timeout)
                    self._share_cpus()
                elif self.isolation == "process":
                    self._backend = WorkerBackend(self.backend_name, timeout=self.timeout, started=started)
                else:
                    self._backend = load_backend(self.backend_name)
            except Exception as exc:  # any import or construction failure is the user's to see
                message = str(exc) if self.isolation == "process" else f"{type(exc).__name__}: {exc}"
                prefix = f"backend {self.backend_name!r} could not be loaded: "
                self._load_error = f"mlaspec: {prefix}{message.removeprefix(prefix)}"
        if self._load_error:
            pytest.fail(self._load_error, pytrace=False)
        return self._backend

    def run_ahead(self, sharded: bool) -> None:
        """Once the cases are collected, unless the run is ``sharded`` (pytest-xdist's workers take the tests in an
        order of its choosing): tell the judged worker the cases in their order, so that it builds each one's inputs
        while it runs the one before (:meth:`~mlaspec.conformance.worker.WorkerBackend.plan`), and start the fork
        that computes their references from the last backwards (:func:`~mlaspec.conformance.ahead.start_ahead`), as
        ``mlaspec check`` does."""
        backend = self._backend
        if sharded or self.worker is not None or not self.cases or not hasattr(backend, "plan"):
            return
        from .ahead import start_ahead

        backend.plan(self.cases)
        self._ahead = start_ahead(
            backend,
            self.cases,
            scale=self.scale,
            strict_numerics=self.strict_numerics,
            cache=self.reference_cache(),
            reference_device=self.reference_device,
        )

    def plan_next(self, case, after) -> None:
        """In a pytest-xdist worker, before ``case`` runs: xdist hands each worker its tests in an order of its choosing
        but runs one behind, so the test after it is known (``nextitem``); the judged worker builds ``after``'s inputs
        while the backend runs ``case``, as it does with a whole plan (:meth:`run_ahead`)."""
        backend = self._backend
        if self.worker is not None and case is not None and after is not None and hasattr(backend, "plan"):
            backend.plan([case, after])

    def reached(self, case) -> None:
        """The run takes ``case``: the fork computing references ahead stops before it."""
        if self._ahead is not None and case.id in self._index:
            self._ahead.reached(self._index[case.id])

    @functools.cached_property
    def _index(self) -> dict[str, int]:
        return {c.id: i for i, c in enumerate(self.cases)}

    def record(self, result) -> None:
        """Stream one verdict to ``results.jsonl`` (``results-<worker>.jsonl`` under xdist)."""
        if self.report_dir is None:
            return
        if self._sink is None:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            name = f"results-{self.worker}.jsonl" if self.worker else "results.jsonl"
            self._sink = open(self.report_dir / name, "w")  # noqa: SIM115 - closed at session finish
            from .report import environment, header_line

            backend = self.backend()
            self._sink.write(header_line(self.backend_name, backend.version, environment(), self.planned) + "\n")
        self._sink.write(json.dumps(result.to_json()) + "\n")
        self._sink.flush()

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.stop()
            self._ahead = None
        if self._sink is not None:
            self._sink.close()
            self._sink = None
        if self._backend is not None and hasattr(self._backend, "close"):
            self._backend.close()
        if self._started is not None:  # started, never needed (no test of this session asked for the backend)
            self._started.kill()
            self._started = None
        self._share.close()  # this process's threads as they were


_KEY = pytest.StashKey[_State]()


def _state(config: pytest.Config) -> _State:
    if _KEY not in config.stash:
        raise pytest.UsageError(
            "the mlaspec pytest plugin is not loaded: install mlaspec (it registers the plugin) or pass "
            "-p mlaspec.conformance.plugin"
        )
    return config.stash[_KEY]


def _register_markers(config: pytest.Config) -> None:
    """One marker per op (``-m mla_decode``); needs the ops table, so only once the plugin is in use."""
    state = _state(config)
    if state.markers_registered:
        return
    from .ops import OPS

    for name, op in OPS.items():
        config.addinivalue_line("markers", f"{name}: mlaspec conformance cases of {name} ({op.doc})")
    state.markers_registered = True


def worker_device(device: str, worker: str | None, n_gpus: int) -> str:
    """The device of one pytest-xdist worker: ``cuda`` on worker ``gwN`` with several GPUs is ``cuda:<N % n_gpus>``;
    anything else (``cpu``, ``cuda:1``, one GPU, no xdist) is ``device`` unchanged."""
    if device != "cuda" or not worker or n_gpus < 2 or not worker.startswith("gw"):
        return device
    return f"cuda:{int(worker[2:]) % n_gpus}"


def pytest_configure(config: pytest.Config) -> None:
    state = _State.from_config(config)
    config.stash[_KEY] = state
    device = config.getoption("mla_device")
    if device:
        n_gpus = 0
        if device == "cuda" and state.worker:
            import torch

            n_gpus = torch.cuda.device_count()
        os.environ["MLASPEC_DEVICE"] = device = worker_device(device, state.worker, n_gpus)
        if device.startswith("cuda:"):
            import torch

            torch.cuda.set_device(torch.device(device))
    if state.backend_name is None:
        return  # not in use: options only
    state.start()  # its imports beside the ops' below (and, in an xdist worker, the collection)
    _register_markers(config)
    if state.worker is None:  # the controller, or a run without xdist: a backend that cannot load is one usage error
        try:
            backend = state.backend()
        except BaseException as exc:  # pytest.fail's exception carries the reason
            raise pytest.UsageError(str(getattr(exc, "msg", exc))) from None
        if getattr(config.option, "numprocesses", None) and hasattr(backend, "close"):
            backend.close()  # xdist's workers run the cases, each with a worker of its own
    if state.report_dir is not None and state.worker is None and state.report_dir.is_dir():
        for stale in state.report_dir.glob("results*.jsonl"):  # this run's verdicts only
            stale.unlink()


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    state = config.stash.get(_KEY, None)
    if state is None or state.backend_name is None:
        return None
    try:
        backend = state.backend()
        what = backend.version if backend.name == state.backend_name else f"{backend.name}, {backend.version}"
    except BaseException as exc:  # pytest.fail's exception too: the header reports, the tests fail
        what = f"NOT LOADABLE: {exc}"
    from .report import environment

    env = ", ".join(f"{k} {v}" for k, v in environment().items())
    variables = ", ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MLASPEC_"))
    return [
        f"mlaspec: backend {state.backend_name} ({what}), scale {state.scale}, dtypes {','.join(state.dtypes)}, "
        f"report {state.report_dir or '-'}",
        f"mlaspec environment: {env}" + (f"; {variables}" if variables else ""),
    ]


def _case_of(item) -> Any:
    """The curated case a test item checks, or None (a generated test, another test, no item)."""
    return getattr(getattr(item, "callspec", None), "params", {}).get("mla_case")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    state = item.config.stash.get(_KEY, None)
    if state is not None:
        state.plan_next(_case_of(item), _case_of(nextitem))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    state = config.stash.get(_KEY, None)
    if state is None:
        return
    if state.backend_name is not None:  # the cases this run plans: the results file's header names them
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            if "mla_case" in params:
                state.planned.append(params["mla_case"].id)
                state.cases.append(params["mla_case"])
            elif "mla_op" in params:
                state.planned.append(f"{params['mla_op']}[generated]")
        state.run_ahead(sharded=bool(getattr(config.option, "numprocesses", None)))
        return
    if any("mla_backend" in getattr(item, "fixturenames", ()) for item in items):
        raise pytest.UsageError(_missing_backend())


def _missing_backend() -> str:
    from .backend import available_backends

    return MISSING_BACKEND.format(names=", ".join(sorted(available_backends())) or "none")


def _nothing_checked(session: pytest.Session) -> None:
    """Exit 5 (pytest's "no tests") when no conformance test passed, every one skipped, unless --mla-allow-empty:
    a run that checked nothing must not look green. The terminal reporter holds every report, xdist's workers' too;
    ours carry their verdict (:func:`_properties`), whatever their node id (``test_conformance.py::...`` where the
    package lies outside the rootdir, as in a user's project)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or session.config.getoption("mla_allow_empty"):
        return
    ours = [r for r in reporter.stats.get("passed", []) if ("mlaspec_verdict", "pass") in r.user_properties]
    if not ours:
        reporter.write_line("mlaspec: NOTHING CHECKED: no conformance case passed (--mla-allow-empty accepts that)")
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = session.config.stash.get(_KEY, None)
    if state is None:
        return
    state.close()
    if state.backend_name is not None and state.worker is None and session.exitstatus == pytest.ExitCode.OK:
        _nothing_checked(session)
    if state.report_dir is None or state.worker is not None or not state.report_dir.is_dir():
        return
    if not any(state.report_dir.glob("results*.jsonl")):
        return
    from .report import environment, load_results, write_html

    try:
        backend = state.backend()
        version = backend.version
    except BaseException:  # a backend that never loaded still gets its (all-error) report
        version = "not loadable"
    env = environment()
    (state.report_dir / "environment.json").write_text(
        json.dumps({"backend": state.backend_name, "version": version, **env})
    )
    write_html(load_results(state.report_dir), state.report_dir, backend=state.backend_name, version=version, env=env)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_KEY, None)
    if state is not None and state.report_dir is not None and (state.report_dir / "report.html").exists():
        terminalreporter.write_line(f"mlaspec report: {state.report_dir / 'report.html'}")


# -- what the test module uses --------------------------------------------------------------------------------------
def generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``mla_case`` over the curated cases (ids = case ids) and ``mla_op`` over the ops that have a case
    generator, each marked with its op."""
    config = metafunc.config
    state = _state(config)
    if state.backend_name is None and state.worker is not None:
        # a pytest-xdist worker: a usage error would crash it, a collection error is shown once, as this message
        raise pytest.Collector.CollectError(_missing_backend())
    _register_markers(config)
    if "mla_case" in metafunc.fixturenames:
        from .cases import curated_cases

        cases = curated_cases(scale=state.scale, dtypes=state.dtypes)
        metafunc.parametrize("mla_case", [pytest.param(c, id=c.id, marks=getattr(pytest.mark, c.op)) for c in cases])
    if "mla_op" in metafunc.fixturenames:
        try:
            from .generated import generated_ops
        except ImportError:  # no hypothesis: one test that skips and says so
            metafunc.parametrize("mla_op", [pytest.param(None, id="no-hypothesis")])
            return
        metafunc.parametrize(
            "mla_op", [pytest.param(op, id=op, marks=getattr(pytest.mark, op)) for op in generated_ops()]
        )


def assert_conforms(result) -> None:
    """Skip with the backend's reason, or fail with the verdict's reason and the reproducer line."""
    __tracebackhide__ = True
    if result.verdict == "skip":
        pytest.skip(result.reason)
    if result.verdict != "pass":  # fail, error, crash, timeout
        from .verdict import format_failure

        raise AssertionError(format_failure(result))


def _properties(node, result) -> None:
    """JUnit XML ``<property>`` entries of a verdict."""
    node.user_properties.extend([("mlaspec_verdict", result.verdict), ("mlaspec_repro", result.repro)])
    if result.reason:
        node.user_properties.append(("mlaspec_reason", result.reason))


@pytest.fixture(scope="session")
def mla_backend(pytestconfig: pytest.Config):
    """The backend under test (``--mla-backend`` / ``MLASPEC_BACKEND``)."""
    return _state(pytestconfig).backend()


@pytest.fixture
def mla_check(request: pytest.FixtureRequest, mla_backend):
    """``mla_check(case)``: run one curated case on the backend, record it, and pass, skip or fail the test."""
    state = _state(request.config)

    def check(case) -> None:
        __tracebackhide__ = True
        from .runner import run_case

        state.reached(case)
        result = run_case(
            mla_backend,
            case,
            backend_name=state.backend_name,
            scale=state.scale,
            timeout=state.timeout,
            figure_dir=state.figure_dir,
            strict_numerics=state.strict_numerics,
            reference_device=state.reference_device,
            cache=state.reference_cache(),
        )
        state.record(result)
        _properties(request.node, result)
        assert_conforms(result)

    return check


@pytest.fixture
def mla_check_generated(request: pytest.FixtureRequest, mla_backend):
    """``mla_check_generated(op)``: hypothesis draws ``--mla-examples`` cases of ``op`` (seed ``--mla-seed``); a
    failure is shrunk to a minimal case, which is recorded and reported as a ``Case(...)`` literal and a command."""
    state = _state(request.config)

    def check(op: str) -> None:
        __tracebackhide__ = True
        pytest.importorskip("hypothesis", reason="generated cases need hypothesis (pip install hypothesis)")
        from hypothesis import HealthCheck, assume, given, seed, settings
        from hypothesis.errors import Unsatisfiable

        from .backend import missing_op_reason, skip_reason
        from .generated import case_strategy, generated_ops
        from .runner import run_case
        from .verdict import FAILED, Result, format_failure

        backend = mla_backend
        if op not in generated_ops():
            pytest.skip(f"no case generator for {op}")
        if op not in backend.ops:
            pytest.skip(missing_op_reason(backend, op))
        dtypes = tuple(d for d in state.dtypes if d in backend.dtypes)
        if not dtypes:
            pytest.skip(f"{backend.name} supports none of the dtypes {', '.join(state.dtypes)}")
        last: dict[str, Any] = {}
        skipped: list[str] = []

        def run(case, figure_dir=None):
            return run_case(
                backend,
                case,
                backend_name=state.backend_name,
                timeout=state.timeout,
                figure_dir=figure_dir,
                strict_numerics=state.strict_numerics,
                reference_device=state.reference_device,
                cache=state.reference_cache(),
            )

        @seed(state.seed)
        @settings(
            max_examples=state.examples,
            deadline=None,
            database=None,
            derandomize=False,
            report_multiple_bugs=False,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=case_strategy(op, dtypes))
        def generated(case):
            reason = skip_reason(backend, case)
            if reason:
                skipped.append(reason)
            assume(reason is None)
            last["case"], last["n"] = case, last.get("n", 0) + 1
            result = last["result"] = run(case)
            if result.verdict in FAILED:
                raise AssertionError(f"{result.verdict.upper()}: {result.reason}")

        try:
            generated()
        except Unsatisfiable:
            example = skipped[0] if skipped else "?"
            pytest.skip(f"{backend.name} supports none of the generated {op} cases, e.g. {example}")
        except AssertionError:
            case = last["case"]  # hypothesis replays the minimal failing case last
            result = run(case, state.figure_dir) if state.report_dir is not None else last["result"]
            state.record(result)
            _properties(request.node, result)
            raise AssertionError(f"generated {op} case {format_failure(result)}\n  minimal case: {case!r}") from None
        summary = Result(
            f"{op}[generated]",
            op,
            ",".join(dtypes),
            "pass",
            reason=f"{last.get('n', 0)} generated cases (seed {state.seed}), {len(skipped)} unsupported "
            f"ones drawn and discarded",
        )
        state.record(summary)

    return check
