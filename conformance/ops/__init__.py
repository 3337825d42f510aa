"""The ops the harness checks: a case's inputs, the float64 spec reference, and each output's error budget.

An op is named after the spec function it checks, and a backend implements a method of that name taking the same
keyword arguments (see :mod:`mlaspec.conformance.backend`). Inputs are *hostile by default*: irregular sizes,
logits large enough that a wrong scale shows, empty rows where the op allows them.

**Budgets are derived, per element, not picked.** The reference runs in float64 on the very inputs the backend
got (already rounded to the case dtype), so input rounding is no error source. A good kernel then rounds in three
places: the logits (fp32 accumulation of a ``D``-long dot product: ``|δs| <= D ε32 scale Σ|q||k|``), the softmax
weights ``P`` (rounded to the case dtype before ``P @ V``: ``u`` relative), and the output (``u/2`` relative), with
``u`` the unit roundoff of the case dtype (``2^-8`` bf16, ``2^-11`` fp16, ``2^-24`` fp32). Propagated through
attention, with ``M = Σ_j p_j |v_j|`` the magnitude the output is averaged from (the spec's own attention over
``|v|``) and a logit error ``δs`` perturbing each weight by at most ``2 δs`` relatively::

    |out - ref| <= 2 * (u |ref| + (u + 2 δs) M)          per element (the factor 2 is headroom)
    |lse - ref| <= 2 * (δs + S_kv ε32 + ε32 |ref|)       per row (the fp32 sum of S_kv exponentials, its log)

A case passes when every element is within its bound and ±inf/NaN positions agree exactly.
"""

from .common import DTYPES, EPS32, Op, unit_roundoff
from .dense import OPS as _DENSE
from .fp8_decode import OPS as _FP8_DECODE
from .indexer import OPS as _INDEXER
from .serving import OPS as _SERVING
from .sparse import OPS as _SPARSE

__all__ = ["Op", "OPS", "DTYPES", "EPS32", "unit_roundoff"]

OPS: dict[str, Op] = {op.name: op for op in [*_DENSE, *_FP8_DECODE, *_SERVING, *_INDEXER, *_SPARSE]}
