"""Regenerate the figures of docs/dcp.md: the sharding, and the error of the torch backend's DCP decode (CPU)
against the world size.

Run from the repository root: ``python docs/img/make_dcp.py``.
"""

from pathlib import Path

from mlaspec.conformance.backends.torch_eager import TorchBackend
from mlaspec.conformance.cases import Case
from mlaspec.conformance.ops import OPS
from mlaspec.conformance.viz.dcp import draw_dcp_error, draw_dcp_sharding

OUT = Path(__file__).parent
WORLD_SIZES = (1, 2, 4, 8, 16)


def error_vs_world_size(dtype: str, interleave: int) -> dict[int, float]:
    """``max |out - ref| / max |ref|`` of the torch backend on a DeepSeek-V3 TP8 decode (2 x 1024 keys)."""
    op, backend, errors = OPS["dcp_decode"], TorchBackend(), {}
    for n in WORLD_SIZES:
        params = dict(B=2, S_q=1, S_kv=1024, H_q=16, D_qk=576, D_v=512, causal=True, world_size=n)
        kw = op.make_inputs(Case("dcp_decode", "error-vs-world-size", dtype, dict(params, interleave=interleave)))
        out = backend.dcp_decode(**kw)[0].double()
        ref = op.reference(**kw)[0]
        errors[n] = float((out - ref).abs().max() / ref.abs().max())
    return errors


if __name__ == "__main__":
    draw_dcp_sharding(40, 4, [1, 2, 8]).savefig(OUT / "dcp_sharding.png", dpi=110)
    series = {f"torch {d}, I = {i}": error_vs_world_size(d, i) for d in ("bfloat16", "float32") for i in (1, 64)}
    draw_dcp_error(series).savefig(OUT / "dcp_error_vs_world_size.png", dpi=110)
    print("wrote", OUT / "dcp_sharding.png", OUT / "dcp_error_vs_world_size.png")
