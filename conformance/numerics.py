"""Declared numerics: the arithmetic departures real kernels make, named, each with the source that shows it.

The budgets of :mod:`mlaspec.conformance.ops` assume a kernel that rounds only where the model says (fp32
accumulation, the softmax weights and the output rounded to the case dtype). Some production kernels depart from that
by design, in hardware or in their code. A departure is not a tolerance: an adapter *declares*, per op, the departures
its kernel makes (``numerics = {"indexer_logits": ("fp8_mma_accumulation",)}``), and the harness then judges against
exactly that arithmetic — the budget term the departure changes, no other — and records it with the verdict.
``mlaspec check --strict-numerics`` (pytest: ``--mla-strict-numerics``) ignores every declaration and judges against
the exact spec.

The vocabulary (:data:`DEPARTURES`):

* ``fp8_mma_accumulation`` — Hopper's fp8 tensor-core MMA (``wgmma ... e4m3``, SASS ``QGMMA``) keeps about 14 bits of
  its accumulator and drops the rest of each addend: the product's magnitude comes out systematically small. DeepSeek
  measured it (DeepSeek-V3 Technical Report, arXiv:2412.19437, §3.3.2 "Increasing Accumulation Precision": "the
  accumulation precision of FP8 GEMM on NVIDIA H800 GPUs is limited to retaining around 14 bits"); DeepGEMM promotes
  to fp32 on CUDA cores every 128 products for that reason (deepseek-ai/DeepGEMM README, "two-level accumulation"),
  so a 128-long dot product (the indexer's head dimension) is one MMA accumulation. Under it the accumulation unit
  roundoff is ``2^-14`` instead of ``ε32`` (every ``γ_n`` of the budget, so the logits' and the LSE's), and the bias
  check's floor is ``2^-14`` relative: the check still fails a lean beyond what the accumulator's resolution explains.
  Seen on the H200 (``docs/backends.md``): DeepGEMM's ``fp8_mqa_logits`` and our Triton indexer (``tl.dot`` on e4m3,
  ``impl/indexer.py``) both lean by ``-4e-5`` relative on every row.
* ``lse_in_query_dtype`` — the LSE is written into a buffer of the query dtype: vLLM 0.33's Triton MLA decode
  allocates ``lse = torch.zeros(B, H, dtype=q.dtype)`` (``vllm/v1/attention/backends/mla/triton_mla.py``) and its
  stage-2 kernel stores ``e_max + tl.log(e_sum)`` there (``vllm/v1/attention/ops/triton_decode_attention.py``). The
  LSE's budget gains that one rounding, ``2 u |lse|`` (the factor 2 as everywhere); in bf16 that is ``0.07`` at an
  LSE of 18, which is what a DCP merge of such partial results inherits.
* ``scales_in_bf16`` — an fp8 sparse cache's per-group fp32 scale is read as bf16 and the key dequantized as a bf16
  product: FlashMLA's SM90 sparse decode, ``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh`` line 550 (``scales[i] =
  (bf16)scales_float[i];``) and ``csrc/sm90/decode/sparse_fp8/components/dequant.h`` line 25
  (``__float22bfloat162_rn(fp8) * scale_bf162``), deepseek-ai/FlashMLA at ``9241ae3``. Not a wider budget: the
  op's *reference* reads the cache as that kernel does, ``bf16(e4m3 * bf16(s))`` per group
  (:func:`mlaspec.conformance.ops.writers.read_as`), and the budget is the exact one around it. Exact on
  power-of-two scales (FlashMLA's own quantizer, vLLM's writers since PR #49435, e8m0); on vLLM 0.33's raw ``amax /
  448`` scales each key moves by up to ``2^-9`` relative, which the fp32-logit budget does not hold.
* ``keys_in_query_dtype`` — an fp8 cache's keys are dequantized in fp32 (``e4m3 * s``, the stored scale) and
  rounded to the query's dtype for a bf16 / fp16 ``Q K^T`` MMA: our Triton sparse kernel, ``impl/sparse.py`` line
  113 (``k_nope = tl.reshape(vals * scale[:, :, None], [BLOCK_N, D_V])``, fp32) and line 290
  (``k_nope.to(q_nope.dtype)`` into the ``tl.dot``); the ``triton`` adapter hands it a cache whose fp8 records it
  cannot rebuild from q's dtype as rows in q's dtype, the same rounding. The reference reads
  the cache that way (``dtype(e4m3 * s)`` per group). Exact on power-of-two scales; on raw scales each key moves by
  up to half an ulp of the query dtype. Unlike ``scales_in_bf16`` the scale itself is not rounded.
* ``p_in_e4m3`` — the softmax weights ``P`` are rounded to e4m3 (not the case dtype) before ``P V``: an fp8
  tensor-core ``P V`` takes both operands in fp8. FlashMLA's dense fp8 decode, which vLLM 0.33 ships as
  ``_flashmla_extension_C.fwd_kvcache_mla_fp8``: vllm-project/FlashMLA ``csrc/extension/sm90/dense_fp8/
  flash_fwd_mla_kernel.h`` lines 384-385 at ``46d64a8`` (``Tensor tOrP = make_tensor_like<Element>(tOrP_acc);
  convert_type_out(tOrP_acc, tOrP);`` with ``Element = cutlass::float_e4m3_t``), fed to ``flash::gemm(tiled_mma_o,
  tOrP, tOrVt, tOrO)`` at line 398. The output budget's weight term becomes e4m3's: ``2^-4`` relative and ``2^-10``
  absolute below e4m3's smallest normal (:mod:`mlaspec.conformance.ops.fp8_decode`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = [
    "DEPARTURES",
    "Departure",
    "accumulation_roundoff",
    "active",
    "assuming",
    "bias_floor",
    "declared",
    "key_format",
    "lse_rounded",
    "p_format",
    "scale_format",
]


@dataclass(frozen=True)
class Departure:
    """One arithmetic departure: its ``name`` (what an adapter declares), what it does (``doc``), the ``source`` that
    shows a real kernel makes it, and what it changes in the judgement: the accumulation unit roundoff of the
    budgets' ``γ_n`` (``accumulation``) and the bias check's relative floor (``bias_floor``), ``None`` where it
    leaves that alone; ``lse_rounded``: the LSE is stored in the case dtype, so its budget gains that rounding;
    ``scale_format``: the float format (``"bf16"``) the kernel reads an fp8 cache's group scales in, and
    ``key_format`` the one it rounds the dequantized keys to (``"bf16"``, or ``"query"``: the query's dtype), which
    the op's reference then reads the cache in too; ``p_format``: the format (``"e4m3"``) the softmax weights are
    rounded to before ``P V``, whose rounding the output budget then allows instead of the case dtype's."""

    name: str
    doc: str
    source: str
    accumulation: float | None = None
    bias_floor: float | None = None
    lse_rounded: bool = False
    scale_format: str | None = None
    key_format: str | None = None
    p_format: str | None = None


DEPARTURES: dict[str, Departure] = {
    d.name: d
    for d in (
        Departure(
            "fp8_mma_accumulation",
            "fp8 tensor-core MMA keeps ~14 bits of its accumulator (Hopper QGMMA)",
            "DeepSeek-V3 Technical Report (arXiv:2412.19437) §3.3.2; deepseek-ai/DeepGEMM README",
            accumulation=2.0**-14,
            bias_floor=2.0**-14,
        ),
        Departure(
            "lse_in_query_dtype",
            "the LSE is stored in the query dtype (8 bits in bf16) instead of fp32",
            "vllm/v1/attention/backends/mla/triton_mla.py (vLLM 0.33): lse = torch.zeros(B, H, dtype=q.dtype) for "
            "decode_attention_fwd, whose stage 2 stores e_max + log(e_sum) into it",
            lse_rounded=True,
        ),
        Departure(
            "scales_in_bf16",
            "an fp8 cache's group scales read as bf16, keys dequantized as bf16(e4m3 * bf16(scale))",
            "deepseek-ai/FlashMLA csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh:550 scales[i] = (bf16)scales_float[i]; "
            "csrc/sm90/decode/sparse_fp8/components/dequant.h:25 __float22bfloat162_rn(fp8) * scale_bf162",
            scale_format="bf16",
            key_format="bf16",
        ),
        Departure(
            "keys_in_query_dtype",
            "an fp8 cache's keys dequantized in fp32 and rounded to the query dtype for the Q K^T MMA",
            "mlaspec impl/sparse.py:113 k_nope = vals * scale (fp32), :290 k_nope.to(q_nope.dtype) into tl.dot",
            key_format="query",
        ),
        Departure(
            "p_in_e4m3",
            "the softmax weights P rounded to e4m3 (not the case dtype) for an fp8 tensor-core P V",
            "vllm-project/FlashMLA csrc/extension/sm90/dense_fp8/flash_fwd_mla_kernel.h:384-385 make_tensor_like<"
            "Element>(tOrP_acc); convert_type_out(tOrP_acc, tOrP) with Element = cutlass::float_e4m3_t, then "
            "flash::gemm(tiled_mma_o, tOrP, tOrVt, tOrO) (line 398)",
            p_format="e4m3",
        ),
    )
}

_ACTIVE: ContextVar[tuple[str, ...]] = ContextVar("mlaspec_numerics", default=())


def declared(backend: object, op: str) -> tuple[str, ...]:
    """The departures ``backend`` declares for ``op`` (its ``numerics`` mapping; none if it has none). A name outside
    :data:`DEPARTURES` raises ``ValueError`` naming it: a typo must not pass as exact arithmetic."""
    names = tuple((getattr(backend, "numerics", None) or {}).get(op, ()))
    unknown = [n for n in names if n not in DEPARTURES]
    if unknown:
        raise ValueError(f"backend declares unknown numerics {unknown} for {op}; known: {sorted(DEPARTURES)}")
    return names


@contextmanager
def assuming(names: tuple[str, ...]) -> Iterator[None]:
    """Judge under the departures ``names`` inside the ``with`` block (budgets and the bias check read them)."""
    token = _ACTIVE.set(tuple(names))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _largest(field: str) -> float | None:
    values = [getattr(DEPARTURES[n], field) for n in _ACTIVE.get()]
    values = [v for v in values if v is not None]
    return max(values) if values else None


def accumulation_roundoff(default: float) -> float:
    """The unit roundoff of the budgets' accumulations: ``default`` (``ε32``) unless a departure in force says more."""
    declared_u = _largest("accumulation")
    return default if declared_u is None else max(default, declared_u)


def bias_floor(default: float) -> float:
    """The bias check's relative floor: ``default`` unless a departure in force raises it."""
    declared_floor = _largest("bias_floor")
    return default if declared_floor is None else max(default, declared_floor)


def active() -> tuple[str, ...]:
    """The departures in force (inside :func:`assuming`); a reference that a departure changes reads them."""
    return _ACTIVE.get()


def lse_rounded() -> bool:
    """Whether a departure in force stores the LSE in the case dtype."""
    return any(DEPARTURES[n].lse_rounded for n in _ACTIVE.get())


def _format(field: str) -> str | None:
    formats = {getattr(DEPARTURES[n], field) for n in _ACTIVE.get()} - {None}
    if len(formats) > 1:
        raise ValueError(f"declared numerics give more than one {field}: {sorted(formats)}")
    return formats.pop() if formats else None


def scale_format() -> str | None:
    """The format a departure in force reads an fp8 cache's group scales in (``"bf16"``), or None: the exact scales."""
    return _format("scale_format")


def key_format() -> str | None:
    """The format a departure in force rounds an fp8 cache's dequantized keys to (``"bf16"``, or ``"query"``: the
    query's dtype), or None: the exact keys."""
    return _format("key_format")


def p_format() -> str | None:
    """The format a departure in force rounds the softmax weights to before ``P V`` (``"e4m3"``), or None: the case
    dtype, as the exact spec's budget assumes."""
    return _format("p_format")
