"""The README's picture: |error| / bound of the mla_decode output over heads x positions, for the torch backend
(inside its budget everywhere) and for a backend whose softmax scale is 2% off (outside it). Run from the repo root:
``python docs/img/make_readme.py``."""

from pathlib import Path

from mlaspec.conformance.backends.torch_eager import TorchBackend
from mlaspec.conformance.cases import case_by_id
from mlaspec.conformance.ops import DTYPES, OPS, unit_roundoff
from mlaspec.conformance.verdict import judge
from mlaspec.conformance.viz.errors import draw_error_heatmaps


class ScaleOff(TorchBackend):
    def mla_decode(self, q, kv, *, d_v, scale, causal=False):
        return super().mla_decode(q, kv, d_v=d_v, scale=scale * 1.02, causal=causal)


case = case_by_id("mla_decode[mtp4-bfloat16]")
op = OPS[case.op]
inputs = op.make_inputs(case)
ref = tuple(op.reference(**inputs))
bounds = op.bounds(inputs, ref, unit_roundoff(DTYPES[case.dtype]))
maps = {}
for label, backend in [("torch backend: PASS", TorchBackend()), ("softmax scale 2% off: FAIL", ScaleOff())]:
    ratio = judge(op.outputs, backend.mla_decode(**inputs), ref, bounds)[4]["out"]
    maps[label] = ratio.amax(dim=(0, 3)).T
fig = draw_error_heatmaps(maps, title="mla_decode, DeepSeek-V3 TP8, MTP 4: per-element |error| / derived bound")
fig.savefig(Path(__file__).with_name("readme_heatmap.png"), dpi=90)
