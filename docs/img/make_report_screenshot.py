"""Regenerate docs/img/report_screenshot.png, headless Chromium's view of a real report with failures:
``python docs/img/make_report_screenshot.py`` (needs /usr/bin/chromium: ``apt-get install chromium``).

The backend is eager PyTorch with the softmax scale of the decode 2% off, checked on a few decode and merge cases.
"""

import subprocess
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from mlaspec.conformance.backends.torch_eager import TorchBackend
from mlaspec.conformance.cases import curated_cases
from mlaspec.conformance.report import environment, load_results, write_html
from mlaspec.conformance.runner import run_cases

HERE = Path(__file__).parent
CHROMIUM = "/usr/bin/chromium"


class WrongScale(TorchBackend):
    """Softmax scale 2% off in the decode."""

    def mla_decode(self, q, kv, *, d_v, scale, causal=False):
        return super().mla_decode(q, kv, d_v=d_v, scale=scale * 1.02, causal=causal)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report"
        cases = curated_cases(dtypes=("bfloat16",), ops=("attention", "mla_decode", "merge_attn_states"))
        cases = [c for c in cases if c.op != "mla_decode" or c.name in ("v3-tp8", "mtp2")]
        run_cases(WrongScale(), cases, backend_name="my_kernels:WrongScale", out_dir=out)
        env = {k: v for k, v in environment().items() if k in ("python", "torch")}
        page = write_html(load_results(out), out, backend="my_kernels:WrongScale", version="0.1.0", env=env)
        subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={tmp}/profile",
                "--hide-scrollbars",
                "--window-size=1100,1500",
                f"--screenshot={(HERE / 'report_screenshot.png').resolve()}",
                page.resolve().as_uri(),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


if __name__ == "__main__":
    main()
