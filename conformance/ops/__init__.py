"""The ops the harness checks: a case's inputs, the float64 spec reference, and each output's error budget.

An op is named after the spec function it checks, and a backend implements a method of that name taking the same
keyword arguments (see :mod:`mlaspec.conformance.backend`). Inputs are *hostile by default*: irregular sizes,
logits large enough that a wrong scale shows, empty rows where the op allows them.

**Budgets are derived, per element, not picked.** The reference runs in float64 on the very inputs the backend
got (already rounded to the case dtype), so input rounding is no error source. A good kernel then rounds in three
places: the logits (fp32 accumulation of a ``D``-long dot product: ``|δs| <= γ_D scale Σ|q||k|``, ``γ_D ≈ D ε32``
below), the softmax weights ``p`` (rounded to the case dtype before ``p @ v``: ``u`` relative), and the output (``u/2``
relative), with ``u`` the unit roundoff of the case dtype (``2^-8`` bf16, ``2^-11`` fp16, ``2^-24`` fp32).
Propagated through attention, with ``M = Σ_j p_j |v_j|`` the magnitude the output is averaged from (the spec's own
attention over ``|v|``) and a logit error ``δs`` perturbing each weight by at most ``2 δs`` relatively::

    |out - ref| <= 2 * (u |ref| + (u + 2 δs) M)          per element (the factor 2 is headroom)
    |lse - ref| <= 2 * (δs + S_kv ε32 + ε32 |ref|)       per row (the fp32 sum of S_kv exponentials, its log)

**Projections** (``mla_prefill``, ``chunked_prefill_attention``, the prefills of ``mla_mixed_batch``: ``k_nope =
kv_c W_UK`` and ``v = kv_c W_UV``; ``mla_absorbed`` and the decodes of ``mla_mixed_batch``: ``ql_nope = q_nope
W_UK^T`` and ``o_lat W_UV``) are dot products of length ``n`` (``Lkv``, or ``D_nope`` for the absorbed query) that a
conforming kernel accumulates in fp32 (``u_w = ε32`` whatever the case dtype: a bf16 or fp16 accumulator would make
``n u_w >= 1`` for ``n = 512``, and no bound exists; tensor-core GEMMs on bf16 / fp16 accumulate in fp32) and may then
round to the case dtype. Higham's bound for any summation order gives, per element of ``y = x W``::

    |ŷ - y| <= u/2 |y| + (1 + u/2) γ_n (|x| @ |W|),    γ_n = n u_w / (1 - n u_w)

(:func:`~mlaspec.conformance.ops.common.projection_error`). The first term is the rounding already in the budgets,
the second the accumulation. Both are elementwise perturbations of keys / values / the query, carried as such: a
perturbation ``δk`` of the keys moves a row's logits by at most ``scale max_j Σ_d |q_d| δk_jd`` (added to ``δs``,
hence to both the output and the LSE budget), a perturbation ``δv`` moves the output by at most ``Σ_j p_j δv_j`` (the
spec's weights; inside the factor 2). Where ``Σ |x||W|`` is much larger than ``|y|`` (terms that cancel) this
accumulation term, not the rounding, is what an fp32 case's budget is made of. It is worst case: at ``Lkv = 512``
it is about ``1e-3`` of a typical fp32 value (``γ_512 ≈ 3e-5`` times ``Σ|x||W| / |y| ≈ 15``, twice for the
headroom), so there an fp32 case no longer tells fp32 accumulation from a TF32 GEMM or a projection ``1e-3`` off;
at the generated and most curated sizes (``Lkv <= 64``) it does. At ``Lkv = 512`` it grows the median budget 1.2x for
bf16 and 2.3x for fp16 (``ε32 Σ|x||W|`` against ``u |y|``); at ``Lkv <= 64`` the median by 2% at most.

A case passes when every element is within its bound and ±inf/NaN positions agree exactly.
"""

from collections.abc import Iterable

from .common import DTYPES, EPS32, LIMITS, Op, Scale, unit_roundoff
from .dcp import OPS as _DCP
from .dense import OPS as _DENSE
from .fp8_decode import OPS as _FP8_DECODE
from .indexer import OPS as _INDEXER
from .serving import OPS as _SERVING
from .sparse import OPS as _SPARSE

__all__ = ["DTYPES", "EPS32", "LIMITS", "OPS", "Op", "Scale", "implemented_ops", "register", "unit_roundoff"]

OPS: dict[str, Op] = {}
"""The op registry: name -> :class:`Op`. The curated cases, the generated ops, the ``spec`` backend, the docs'
op table and the ``triton`` adapter's op set are all derived from it."""


def register(op: Op) -> Op:
    """Add ``op`` to :data:`OPS` (``ValueError`` if its name is taken): the one step that makes a new op known to
    the CLI, the pytest plugin, the ``spec`` backend and the generated cases. Returns ``op``."""
    if not isinstance(op, Op):
        raise TypeError(f"op must be an Op, got {type(op).__name__}")
    if op.name in OPS:
        raise ValueError(f"op name {op.name!r} is already registered")
    OPS[op.name] = op
    return op


def implemented_ops(backend: object, among: Iterable[str] | None = None) -> frozenset[str]:
    """The registered op names ``backend`` (an object or a class) has a method for: an adapter's ``ops`` derived
    from what it defines, so a new method is a new op without a second list to edit."""
    names = OPS if among is None else among
    return frozenset(name for name in names if name in OPS and callable(getattr(backend, name, None)))


for _op in [*_DENSE, *_DCP, *_FP8_DECODE, *_SERVING, *_SPARSE, *_INDEXER]:
    register(_op)
