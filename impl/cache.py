"""Paged MLA cache ops: ``concat_and_cache_mla`` (bf16/fp16, per-tensor fp8, the 656-byte ``fp8_ds_mla`` token),
``gather_cache`` (``cp_gather_cache`` with ``seq_starts``), the records' dequantization and a page-record read.

Implements :func:`mlaspec.spec.paged_cache.concat_and_cache_mla`, :func:`mlaspec.spec.paged_cache.gather_cache`,
:func:`mlaspec.spec.cache_layouts.quantize` / :func:`~mlaspec.spec.cache_layouts.dequantize` (the 656-byte and
per-tensor layouts) and :func:`mlaspec.spec.cache_layouts.read_tokens` (any layout, split rows included). The
conventions, as the spec states them (vLLM ``csrc/cache_kernels.cu``):

* an entry is ``[kv_c (512) | k_pe (64)]``; a slot ``-1`` (padding token) writes nothing;
* ``"auto"``: a cast to the cache dtype; ``"fp8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"``: ``fp8(clamp(x / scale))``
  for all 576 values with the fp32 per-tensor ``scale`` (``__NV_SATFINITE``);
* ``"fp8_ds_mla"`` (656 bytes, FlashMLA ``README.md``): 512 e4m3 values in 4 groups of 128, each divided by its
  fp32 scale ``s_g = max(amax_g / 448, FLT_MIN)`` (vLLM's ``concat_and_cache_ds_mla_kernel`` stores the raw
  ``amax / 448``, not a power of two), then the 4 scales (bytes 512..527), then the 64 RoPE values as bf16
  (bytes 528..655);
* ``gather_cache``: request ``b``'s token ``seq_starts[b] + i`` goes to row ``cu_seq_lens[b] + i``, copied bit for
  bit; ``gather_and_maybe_dequant_cache`` offsets the block table by whole blocks (``seq_starts[b] // P``).

Rounding is done with integer arithmetic on the fp32 bits, not with Triton's casts, so that the bytes are the
same on a GPU and in the interpreter (whose fp32 -> bf16 cast truncates): divisions are ``div_rn`` (correctly
rounded, so ``amax / 448`` is the spec's fp32 scale byte for byte), fp8 values are rounded to nearest even on a
power-of-two quantum, then saturated and packed into their bit fields; bf16 is rounded to nearest even on the bits.

Traffic: every kernel is a copy with arithmetic on the way, one program per token (or per tile of tokens):
``concat_and_cache_mla`` reads ``576`` input values and writes one record; ``gather_cache`` reads and writes
``T`` records.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaspec.spec import cache_layouts as cl

__all__ = [
    "FORMATS",
    "MODES",
    "concat_and_cache_mla",
    "dequantize_records",
    "gather_cache",
    "quantize_records",
    "read_tokens",
]

FLT_MIN = float(torch.finfo(torch.float32).tiny)
# name -> (mantissa bits, smallest normal exponent, exponent bias, largest finite)
FORMATS = {"e4m3": (3, -6, 7, 448.0), "e5m2": (2, -14, 15, 57344.0)}
MODES = {"auto": 0, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_ds_mla": 2}
_PER_TENSOR_FMT = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _fp8_code(x, MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr, MAXQ: tl.constexpr):
    """fp32 ``x`` -> the fp8 byte (int32) of ``round_to_nearest_even(x)``, saturated at ``±MAXQ``; NaN -> 0x7F."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80  # the sign bit, also for -0 and for values that round to 0
    ax = tl.minimum(tl.abs(x), MAXQ)  # saturate first: MAXQ is representable, rounding stays <= MAXQ
    # -- quantum = 2^(max(floor(log2 |x|), EMIN) - MBITS): the spacing of the format at |x| --------------------------
    e = tl.maximum(((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
    inv_q = ((127 - (e - MBITS)) << 23).to(tl.float32, bitcast=True)
    quant = ((127 + (e - MBITS)) << 23).to(tl.float32, bitcast=True)
    # -- round |x| / quantum to an integer, ties to even (the fp32 add of 2^23 rounds to nearest even) -----------------
    n = ax * inv_q  # exact: a power-of-two scaling
    n = (n + 8388608.0) - 8388608.0
    y = n * quant  # the rounded magnitude, exactly representable in the fp8 format
    # -- pack: normal (exponent field, top MBITS of the mantissa) or subnormal (y / 2^(EMIN - MBITS)) ----------------
    yb = y.to(tl.int32, bitcast=True)
    ey = ((yb >> 23) & 0xFF) - 127
    normal = ((ey + BIAS) << MBITS) | ((yb >> (23 - MBITS)) & ((1 << MBITS) - 1))
    sub = (tl.minimum(y, 2.0**EMIN) * (2.0 ** (MBITS - EMIN))).to(tl.int32)  # clamped: only used below 2^EMIN
    code = tl.where(ey >= EMIN, normal, sub)
    code = tl.where(x != x, 0x7F, code)  # NaN stays NaN (0x7F is NaN in e4m3 and in e5m2)
    return code | sign


@triton.jit
def _fp8_value(code, MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr, E4M3: tl.constexpr):
    """fp8 byte (int32) -> its exact fp32 value (e4m3: 0x7F/0xFF NaN; e5m2: all-ones exponent inf/NaN)."""
    ebits: tl.constexpr = 7 - MBITS
    e = (code >> MBITS) & ((1 << ebits) - 1)
    mant = code & ((1 << MBITS) - 1)
    normal = (((e - BIAS + 127) << 23) | (mant << (23 - MBITS))).to(tl.float32, bitcast=True)
    sub = mant.to(tl.float32) * (2.0 ** (EMIN - MBITS))
    v = tl.where(e == 0, sub, normal)
    if E4M3:
        v = tl.where((e == 15) & (mant == 7), float("nan"), v)
    else:
        v = tl.where(e == 31, tl.where(mant == 0, float("inf"), float("nan")), v)
    return tl.where((code & 0x80) != 0, -v, v)


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bits (int32 in [0, 2^16)), rounded to nearest even; NaN -> 0x7FC0 with its sign."""
    b = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    r = tl.where(x != x, 0x7FC0 | ((b >> 16) & 0x8000), r)
    return r.to(tl.int32)


@triton.jit
def _concat_and_cache_kernel(
    KV_C, K_PE, SLOTS, CACHE, CACHE8, CACHE16, CACHE32, scale,  # the cache: its own dtype, bytes, int16, fp32 words
    stride_kvc, stride_kpe,
    D_V: tl.constexpr, D_R: tl.constexpr, MODE: tl.constexpr, TOKEN_BYTES: tl.constexpr, GROUP: tl.constexpr,
    MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr, MAXQ: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:  # -1: a padding token writes nothing
        v = tl.arange(0, D_V)
        r = tl.arange(0, D_R)
        x = tl.load(KV_C + t.to(tl.int64) * stride_kvc + v)  # [D_V], the input dtype
        xr = tl.load(K_PE + t.to(tl.int64) * stride_kpe + r)  # [D_R]
        if MODE == 0:  # "auto": a cast to the cache dtype (none when the dtypes agree), latent then rope
            row = CACHE + slot * (D_V + D_R)
            tl.store(row + v, x.to(CACHE.dtype.element_ty))
            tl.store(row + D_V + r, xr.to(CACHE.dtype.element_ty))
        elif MODE == 1:  # per-tensor fp8: every value divided by the one fp32 scale, saturated
            row = CACHE8 + slot * TOKEN_BYTES
            x, xr = x.to(tl.float32), xr.to(tl.float32)
            tl.store(row + v, _fp8_code(tl.math.div_rn(x, scale), MBITS, EMIN, BIAS, MAXQ).to(tl.uint8))
            tl.store(row + D_V + r, _fp8_code(tl.math.div_rn(xr, scale), MBITS, EMIN, BIAS, MAXQ).to(tl.uint8))
        else:  # fp8_ds_mla, 656 bytes: 512 e4m3 | 4 fp32 scales | 64 bf16
            G: tl.constexpr = D_V // GROUP
            x, xr = x.to(tl.float32), xr.to(tl.float32)
            xg = tl.reshape(x, (G, GROUP))
            amax = tl.max(tl.abs(xg), axis=1)  # [G], exact
            s = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)  # fp32 amax / 448, FLT_MIN floor
            code = _fp8_code(tl.math.div_rn(xg, s[:, None]), MBITS, EMIN, BIAS, MAXQ)
            tl.store(CACHE8 + slot * TOKEN_BYTES + v, tl.reshape(code, (D_V,)).to(tl.uint8))
            tl.store(CACHE32 + slot * (TOKEN_BYTES // 4) + D_V // 4 + tl.arange(0, G), s)
            bf = _bf16_bits(xr)
            tl.store(CACHE16 + slot * (TOKEN_BYTES // 2) + (D_V + 4 * G) // 2 + r, bf.to(tl.int16))


@triton.jit
def _dequantize_kernel(
    RAW8, RAW16, RAW32, OUT, scale,  # records [T, TOKEN_BYTES] as bytes / int16 / fp32 words; out [T, D_V + D_R] fp32
    D_V: tl.constexpr, D_R: tl.constexpr, MODE: tl.constexpr, TOKEN_BYTES: tl.constexpr, GROUP: tl.constexpr,
    MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr, E4M3: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    v = tl.arange(0, D_V)
    r = tl.arange(0, D_R)
    out = OUT + t * (D_V + D_R)
    code = tl.load(RAW8 + t * TOKEN_BYTES + v).to(tl.int32)
    if MODE == 1:  # per-tensor: fp8 value x scale, one fp32 rounding
        tl.store(out + v, _fp8_value(code, MBITS, EMIN, BIAS, E4M3) * scale)
        code_r = tl.load(RAW8 + t * TOKEN_BYTES + D_V + r).to(tl.int32)
        tl.store(out + D_V + r, _fp8_value(code_r, MBITS, EMIN, BIAS, E4M3) * scale)
    else:  # 656 bytes: group g of 128 values x its fp32 scale; the bf16 rope widened exactly
        G: tl.constexpr = D_V // GROUP
        s = tl.load(RAW32 + t * (TOKEN_BYTES // 4) + D_V // 4 + tl.arange(0, G))
        val = tl.reshape(_fp8_value(code, MBITS, EMIN, BIAS, E4M3), (G, GROUP)) * s[:, None]
        tl.store(out + v, tl.reshape(val, (D_V,)))
        bf = tl.load(RAW16 + t * (TOKEN_BYTES // 2) + (D_V + 4 * G) // 2 + r).to(tl.int32) & 0xFFFF
        tl.store(out + D_V + r, (bf << 16).to(tl.float32, bitcast=True))


@triton.jit
def _gather_cache_kernel(
    CACHE, TABLE, CU, STARTS, OUT,  # cache [num_blocks * P, W] words, table [B, max_blocks], cu [B + 1], starts [B]
    W, stride_tb,
    P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, HAS_STARTS: tl.constexpr,
    ALIGN_STARTS: tl.constexpr,
):  # fmt: skip
    b, pid = tl.program_id(0), tl.program_id(1)
    first = tl.load(CU + b)
    n = tl.load(CU + b + 1) - first
    start = 0
    if HAS_STARTS:
        start = tl.load(STARTS + b)
    if ALIGN_STARTS:  # gather_and_maybe_dequant_cache: the block table offset by whole blocks
        start = start // P * P
    i = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = i < n
    pos = start + i  # logical position within the request
    page = tl.load(TABLE + b.to(tl.int64) * stride_tb + pos // P, mask=ok, other=0).to(tl.int64)
    src = (page * P + pos % P) * W
    dst = (first + i).to(tl.int64) * W
    for w0 in range(0, W, BLOCK_W):  # bit-for-bit copy of each record
        w = w0 + tl.arange(0, BLOCK_W)
        m = ok[:, None] & (w < W)[None, :]
        x = tl.load(CACHE + src[:, None] + w[None, :], mask=m)
        tl.store(OUT + dst[:, None] + w[None, :], x, mask=m)


@triton.jit
def _read_tokens_kernel(
    PAGES, SLOTS, OUT, VALID, page_bytes,  # pages [num_blocks, page_bytes] uint8, slots [N], out [N, TOKEN_BYTES]
    P: tl.constexpr, TOKEN_BYTES: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    ok = slot >= 0
    s = tl.maximum(slot, 0)
    blk, off = s // P, s % P
    j = tl.arange(0, BLOCK)
    j_ok = j < TOKEN_BYTES
    # byte j of token `off`'s record inside its page: interleaved, or data rows then scale rows (split layouts)
    at = off * TOKEN_BYTES + j
    if SPLIT > 0:
        at = tl.where(j < SPLIT, off * SPLIT + j, P * SPLIT + off * (TOKEN_BYTES - SPLIT) + (j - SPLIT))
    keep = j_ok & ((j * 0 + slot) >= 0)  # the slot's validity as a vector (the interpreter wants one)
    x = tl.load(PAGES + blk * page_bytes + at, mask=keep, other=0)
    tl.store(OUT + t * TOKEN_BYTES + j, x, mask=j_ok)
    tl.store(VALID + t, ok.to(tl.int8))


# ---------------------------------------------------------------------------------------------------------------
# Host launchers
# ---------------------------------------------------------------------------------------------------------------


def _views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = cache.view(-1)
    return flat.view(torch.uint8), flat.view(torch.int16), flat.view(torch.float32)


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_cache_dtype: str = "auto",
    scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write ``[kv_c | k_pe]`` into the slots of a paged cache (see the module docstring).

    Args:
        kv_c: ``[T, D_v]`` float, ``D_v`` a power of two (512); ``k_pe``: ``[T, D_rope]`` float (64).
        kv_cache: ``[num_blocks, P, D_v + D_rope]`` float (``"auto"``) or uint8 ``[num_blocks, P, token_bytes]``.
        slot_mapping: ``[T]`` int, ``-1`` skipped.
        kv_cache_dtype: ``"auto"``, ``"fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"`` or ``"fp8_ds_mla"``.
        scale: the per-tensor scale (fp8 per-tensor only).
        out: write into this tensor (vLLM's in-place form); default a copy of ``kv_cache``.

    Returns:
        the written cache.
    """
    if kv_cache_dtype not in MODES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(MODES)}, got {kv_cache_dtype!r}")
    mode = MODES[kv_cache_dtype]
    T, d_v = kv_c.shape
    d_r = k_pe.shape[1]
    if k_pe.shape[0] != T or slot_mapping.shape != (T,):
        raise ValueError(f"kv_c [T, D_v], k_pe [T, D_rope] and slot_mapping [T] disagree: {list(kv_c.shape)}, "
                         f"{list(k_pe.shape)}, {list(slot_mapping.shape)}")  # fmt: skip
    for name, n in (("D_v", d_v), ("D_rope", d_r)):
        if n < 1 or n & (n - 1):
            raise ValueError(f"{name} must be a power of two, got {n}")
    token_bytes = kv_cache.shape[2] * kv_cache.element_size()
    if mode == 0 and kv_cache.shape[2] != d_v + d_r:
        raise ValueError(f"kv_cache must be [num_blocks, P, {d_v + d_r}] for 'auto', got {list(kv_cache.shape)}")
    if mode != 0 and (kv_cache.dtype != torch.uint8 or d_v + d_r != 576):
        raise ValueError(f"{kv_cache_dtype} needs a uint8 cache and 576-wide entries, got {kv_cache.dtype}, "
                         f"{d_v + d_r}")  # fmt: skip
    if mode == 1 and token_bytes != 576:
        raise ValueError(f"kv_cache must be [num_blocks, P, 576] for {kv_cache_dtype}, got {list(kv_cache.shape)}")
    if mode == 2 and token_bytes != cl.FP8_DS_MLA_V32.token_bytes:
        raise ValueError(f"kv_cache must be [num_blocks, P, 656] for fp8_ds_mla, got {list(kv_cache.shape)}")
    if mode == 1:
        if scale is None:
            raise ValueError(f"scale is required for kv_cache_dtype={kv_cache_dtype!r}")
        s = float(torch.as_tensor(scale, dtype=torch.float32).reshape(()))  # vLLM keeps k_scale in fp32
    elif scale is not None:
        raise ValueError(f"scale must be None for kv_cache_dtype={kv_cache_dtype!r}")
    else:
        s = 1.0
    fmt = FORMATS[_PER_TENSOR_FMT.get(kv_cache_dtype, "e4m3")]
    new = kv_cache.clone(memory_format=torch.contiguous_format) if out is None else out
    if T == 0:
        return new
    dev = new.device
    kv_c, k_pe = (x.to(dev) if x.stride(-1) == 1 else x.to(dev).contiguous() for x in (kv_c, k_pe))
    slots = slot_mapping.to(device=dev, dtype=torch.int64).contiguous()
    c8, c16, c32 = _views(new) if token_bytes % 4 == 0 else (new.view(-1).view(torch.uint8), new, new)
    _concat_and_cache_kernel[(T,)](
        kv_c, k_pe, slots, new, c8, c16, c32, s, kv_c.stride(0), k_pe.stride(0),
        D_V=d_v, D_R=d_r, MODE=mode, TOKEN_BYTES=token_bytes, GROUP=128,
        MBITS=fmt[0], EMIN=fmt[1], BIAS=fmt[2], MAXQ=fmt[3], num_warps=4,
    )  # fmt: skip
    return new


def _layout_mode(layout: cl.CacheLayout) -> tuple[str, int]:
    if layout is cl.FP8_DS_MLA_V32 or layout.name == cl.FP8_DS_MLA_V32.name:
        return "fp8_ds_mla", 2
    if layout.name == cl.FP8_PER_TENSOR.name:
        return "fp8", 1
    if layout.name == cl.FP8_E5M2_PER_TENSOR.name:
        return "fp8_e5m2", 1
    raise ValueError(f"layout must be one of {cl.FP8_DS_MLA_V32.name}, {cl.FP8_PER_TENSOR.name}, "
                     f"{cl.FP8_E5M2_PER_TENSOR.name}, got {layout.name}")  # fmt: skip


def quantize_records(entries: torch.Tensor, layout: cl.CacheLayout | str, *, scale=None) -> torch.Tensor:
    """``[T, 576]`` entries -> ``[T, token_bytes]`` uint8 records of the 656-byte or a per-tensor fp8 layout."""
    layout = cl.LAYOUTS[layout] if isinstance(layout, str) else layout
    kind, _ = _layout_mode(layout)
    t = entries.shape[0]
    records = torch.empty(t, 1, layout.token_bytes, dtype=torch.uint8, device=entries.device)
    slots = torch.arange(t, device=entries.device)
    return concat_and_cache_mla(entries[:, :512], entries[:, 512:], records, slots, kv_cache_dtype=kind, scale=scale,
                                out=records).view(t, layout.token_bytes)  # fmt: skip


def dequantize_records(raw: torch.Tensor, layout: cl.CacheLayout | str, *, scale=None) -> torch.Tensor:
    """``[T, token_bytes]`` uint8 records of the 656-byte or a per-tensor fp8 layout -> ``[T, 576]`` float32."""
    layout = cl.LAYOUTS[layout] if isinstance(layout, str) else layout
    kind, mode = _layout_mode(layout)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != layout.token_bytes:
        raise ValueError(f"raw must be uint8 [T, {layout.token_bytes}], got {raw.dtype} {list(raw.shape)}")
    if mode == 1:
        if scale is None:
            raise ValueError(f"scale is required for the per-tensor layout {layout.name}")
        s = float(torch.as_tensor(scale, dtype=torch.float32).reshape(()))
    else:
        s = 1.0
    raw = raw.contiguous()
    t = raw.shape[0]
    out = torch.empty(t, 576, dtype=torch.float32, device=raw.device)
    if t == 0:
        return out
    fmt = FORMATS[_PER_TENSOR_FMT.get(kind, "e4m3")]
    r8, r16, r32 = _views(raw) if layout.token_bytes % 4 == 0 else (raw, raw, raw)
    _dequantize_kernel[(t,)](
        r8, r16, r32, out, s, D_V=512, D_R=64, MODE=mode, TOKEN_BYTES=layout.token_bytes, GROUP=128,
        MBITS=fmt[0], EMIN=fmt[1], BIAS=fmt[2], E4M3=fmt[0] == 3, num_warps=4,
    )  # fmt: skip
    return out


def gather_cache(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    batch_size: int | None = None,
    seq_starts: torch.Tensor | None = None,
    *,
    kernel: str = "cp_gather_cache",
    block_t: int = 16,
) -> torch.Tensor:
    """Gather each request's entries into packed rows, bit for bit (see the module docstring).

    Args:
        kv_cache: ``[num_blocks, P, *entry]`` any dtype.
        block_table: ``[B, max_blocks]`` int.
        cu_seq_lens: ``[B + 1]`` int.
        batch_size: ``B`` (must equal ``block_table.shape[0]`` when given).
        seq_starts: optional ``[B]`` int, the first logical position read per request.
        kernel: ``"cp_gather_cache"`` or ``"gather_and_maybe_dequant_cache"`` (block-aligned starts).

    Returns:
        ``entries [T, *entry]``, the cache's dtype.
    """
    if kernel not in ("cp_gather_cache", "gather_and_maybe_dequant_cache"):
        raise ValueError(f"kernel must be 'cp_gather_cache' or 'gather_and_maybe_dequant_cache', got {kernel!r}")
    B = block_table.shape[0]
    if batch_size is not None and batch_size != B:
        raise ValueError(f"batch_size must equal block_table.shape[0]={B}, got {batch_size}")
    P = kv_cache.shape[1]
    dev = kv_cache.device
    cu = cu_seq_lens.to(device=dev, dtype=torch.int32).contiguous()
    starts = None if seq_starts is None else seq_starts.to(device=dev, dtype=torch.int32).contiguous()
    if kernel == "gather_and_maybe_dequant_cache" and starts is not None and bool((starts % P != 0).any()):
        raise ValueError(f"seq_starts must be multiples of block_size P={P} for gather_and_maybe_dequant_cache, "
                         f"got {starts.tolist()}")  # fmt: skip
    lens = cu[1:] - cu[:-1]
    total = int(cu[-1]) if cu.numel() else 0
    out = torch.empty(total, *kv_cache.shape[2:], dtype=kv_cache.dtype, device=dev)
    if total == 0 or B == 0:
        return out
    cache = kv_cache.contiguous()
    row_bytes = cache[0, 0].numel() * cache.element_size()
    word = torch.int32 if row_bytes % 4 == 0 else (torch.int16 if row_bytes % 2 == 0 else torch.uint8)
    src, dst = cache.view(-1).view(word), out.view(-1).view(word)
    w = row_bytes // src.element_size()
    table = block_table.to(device=dev, dtype=torch.int32).contiguous()
    grid = (B, triton.cdiv(int(lens.max()), block_t))
    _gather_cache_kernel[grid](
        src, table, cu, starts if starts is not None else cu, dst, w, table.stride(0),
        P=P, BLOCK_T=block_t, BLOCK_W=min(1024, triton.next_power_of_2(w)), HAS_STARTS=starts is not None,
        ALIGN_STARTS=kernel == "gather_and_maybe_dequant_cache", num_warps=4,
    )  # fmt: skip
    return out


def read_tokens(pages: torch.Tensor, layout: cl.CacheLayout | str, block_size: int,
                slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Records ``[N, token_bytes]`` uint8 at ``slots`` out of page blocks ``[num_blocks, page_bytes]``, ``-1`` -> zeros.

    Returns ``(raw, valid)``: ``valid [N]`` bool marks ``slots >= 0``.
    """
    layout = cl.LAYOUTS[layout] if isinstance(layout, str) else layout
    if pages.dtype != torch.uint8 or pages.dim() != 2:
        raise ValueError(f"pages must be uint8 [num_blocks, page_bytes], got {pages.dtype} {list(pages.shape)}")
    pages = pages.contiguous()
    n = slots.shape[0]
    raw = torch.empty(n, layout.token_bytes, dtype=torch.uint8, device=pages.device)
    valid = torch.empty(n, dtype=torch.int8, device=pages.device)
    if n:
        _read_tokens_kernel[(n,)](
            pages, slots.to(device=pages.device, dtype=torch.int64).contiguous(), raw, valid, pages.shape[1],
            P=block_size, TOKEN_BYTES=layout.token_bytes, SPLIT=layout.split_at or 0,
            BLOCK=triton.next_power_of_2(layout.token_bytes), num_warps=4,
        )  # fmt: skip
    return raw, valid.bool()
