"""Backend ``vllm``: vLLM 0.33's own Triton kernels, loaded from the wheel's Python files.

The full ``vllm`` package rarely imports outside a vLLM install (it pulls in its compiled extensions and a
long dependency list), and the two kernels checked here are self-contained Triton files, so the adapter loads each
file on its own with :mod:`importlib`, giving it a two-line stand-in for the only vLLM names it imports
(``vllm.platforms.current_platform`` and ``vllm.triton_utils``). Where the files come from, first match wins:

1. an importable vLLM (``vllm.v1.attention.ops.triton_merge_attn_states``);
2. ``MLASPEC_VLLM_WHEEL_DIR``: a folder holding ``vllm/v1/attention/ops/*.py`` (an unzipped wheel, or just those
   files), or a ``vllm-*.whl`` file, or a folder with one (the files are extracted to a temporary folder).

Ops:

* ``merge_attn_states`` -> ``vllm/v1/attention/ops/triton_merge_attn_states.py`` ``merge_attn_states(output,
  prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse)``; LSEs ``[H, T]`` natural log, both the
  spec's layout and convention (it *is* the function the spec's merge describes).
* ``mla_decode`` -> ``vllm/v1/attention/ops/triton_decode_attention.py`` ``decode_attention_fwd(...,
  is_mla=True)``, called as ``vllm/v1/attention/backends/mla/triton_mla.py`` (``TritonMLAImpl.forward_mqa``)
  calls it: the paged cache ``[N, P, 1, 576]`` as K and its first 512 columns as V, one program per query row,
  causal multi-token decode expressed as per-row lengths ``seq_len - S_q + 1 + t`` (clamped at 0), the block
  table repeated per row, ``num_kv_splits = min(next_pow2(max(1, max_seq_len // 512)), 2 * SMs)``.
  **vLLM allocates the LSE in the query dtype** (``lse = torch.zeros(B, H, dtype=q.dtype)``), so in bf16 the LSE
  is rounded to 8 bits; the adapter does the same by default (what vLLM returns for DCP merges) and
  ``MLASPEC_VLLM_LSE_FP32=1`` gives the kernel an fp32 buffer instead.

Runs on CUDA, or on CPU under the Triton interpreter (``TRITON_INTERPRET=1``, tiny cases only).
The metadata helpers of ``vllm/v1/attention/backends/utils.py`` need vLLM's dataclasses and are not wired here.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import torch

from .common import page_kv

__all__ = ["VLLMBackend", "load_vllm_file", "find_vllm_source"]

OPS_DIR = "vllm/v1/attention/ops"
FILES = ("triton_merge_attn_states.py", "triton_decode_attention.py")
_MIN_WORK_PER_SPLIT = 512  # vllm/v1/attention/backends/mla/triton_mla.py
_SPLIT_OCCUPANCY_MULTIPLIER = 2


def find_vllm_source() -> Path:
    """The folder that holds ``vllm/v1/attention/ops/`` (see the module docstring), or ``ImportError``."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    for root in list(spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / "v1/attention/ops" / FILES[0]).exists():
            return Path(root).parent
    given = os.environ.get("MLASPEC_VLLM_WHEEL_DIR")
    if not given:
        raise ImportError(
            "vllm's Triton files not found: no importable vllm with vllm/v1/attention/ops, and MLASPEC_VLLM_WHEEL_DIR "
            "is not set (point it at an unzipped vllm 0.33 wheel, at the .whl, or at a folder holding it)"
        )
    path = Path(given)
    if (path / OPS_DIR / FILES[0]).exists():
        return path
    wheels = [path] if path.suffix == ".whl" else sorted(path.glob("vllm-*.whl")) if path.is_dir() else []
    if not wheels:
        raise ImportError(f"MLASPEC_VLLM_WHEEL_DIR={given} holds neither {OPS_DIR}/{FILES[0]} nor a vllm-*.whl")
    out = Path(tempfile.mkdtemp(prefix="mlaspec-vllm-"))
    with zipfile.ZipFile(wheels[0]) as z:
        for f in FILES:
            z.extract(f"{OPS_DIR}/{f}", out)
    return out


def _stand_ins() -> dict[str, types.ModuleType]:
    """``vllm.platforms`` and ``vllm.triton_utils`` as the two Triton files use them (CUDA, not ROCm)."""
    import triton
    import triton.language as tl

    platform = types.SimpleNamespace(
        is_rocm=lambda: False,
        is_cuda=lambda: True,
        is_xpu=lambda: False,
        fp8_dtype=lambda: torch.float8_e4m3fn,
        is_device_capability_family=lambda family: torch.cuda.is_available()
        and torch.cuda.get_device_capability()[0] * 10 == family,
    )
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = platform
    triton_utils = types.ModuleType("vllm.triton_utils")
    triton_utils.tl, triton_utils.triton = tl, triton
    return {"vllm.platforms": platforms, "vllm.triton_utils": triton_utils}


def load_vllm_file(root: Path, relpath: str) -> types.ModuleType:
    """Execute one vLLM source file as a private module, with the stand-ins in ``sys.modules`` only meanwhile."""
    path = Path(root) / relpath
    name = "mlaspec_vllm_" + Path(relpath).stem
    if name in sys.modules:
        return sys.modules[name]
    stand_ins = _stand_ins()
    try:
        importlib.import_module("vllm")
    except ImportError:
        stand_ins["vllm"] = types.ModuleType("vllm")
    saved = {k: sys.modules.get(k) for k in stand_ins}
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        for k, m in stand_ins.items():
            if k == "vllm" or not _importable(k):
                sys.modules[k] = m
        spec.loader.exec_module(module)
    finally:
        for k, m in saved.items():
            if m is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = m
    sys.modules[name] = module  # Triton's JIT finds the source through the module
    return module


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except Exception:  # noqa: BLE001
        return False


def num_kv_splits(max_seq_len: int, sm_count: int) -> int:
    """``min(next_pow2(max(1, max_seq_len // 512)), 2 * SMs)`` (``triton_mla.py`` ``_compute_num_kv_splits``)."""
    ideal = 1 << (max(1, max_seq_len // _MIN_WORK_PER_SPLIT) - 1).bit_length()
    return min(ideal, sm_count * _SPLIT_OCCUPANCY_MULTIPLIER)


class VLLMBackend:
    """vLLM 0.33's Triton ``merge_attn_states`` and Triton MLA decode (see the module docstring)."""

    name = "vllm"
    ops = frozenset({"merge_attn_states", "mla_decode"})
    dtypes = frozenset({"bfloat16", "float16", "float32"})

    def __init__(self, device: str | None = None):
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        if device:
            self.device = torch.device(device)
        elif torch.cuda.is_available():
            self.device = torch.device(os.environ.get("MLASPEC_DEVICE", "cuda"))
        elif interpret:
            self.device = torch.device("cpu")
        else:
            raise RuntimeError("vllm's Triton kernels need CUDA (or TRITON_INTERPRET=1 for tiny CPU runs)")
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            raise ImportError(f"triton not installed: {exc}") from exc
        try:  # an installed vLLM first
            self.merge_mod = importlib.import_module("vllm.v1.attention.ops.triton_merge_attn_states")
            self.decode_mod = importlib.import_module("vllm.v1.attention.ops.triton_decode_attention")
            where = "installed vllm"
        except Exception:  # noqa: BLE001
            root = find_vllm_source()
            self.merge_mod = load_vllm_file(root, f"{OPS_DIR}/{FILES[0]}")
            self.decode_mod = load_vllm_file(root, f"{OPS_DIR}/{FILES[1]}")
            where = str(root)
        self.lse_fp32 = os.environ.get("MLASPEC_VLLM_LSE_FP32") == "1"
        self.page = int(os.environ.get("MLASPEC_VLLM_PAGE", "64"))
        self.version = f"vllm Triton kernels from {where}" + (" (fp32 LSE)" if self.lse_fp32 else "")

    def merge_attn_states(self, prefix_output, prefix_lse, suffix_output, suffix_lse):
        dev = self.device
        p_out, s_out = prefix_output.to(dev).contiguous(), suffix_output.to(dev).contiguous()
        p_lse, s_lse = prefix_lse.to(dev, torch.float32), suffix_lse.to(dev, torch.float32)
        output = torch.empty_like(p_out)
        output_lse = torch.empty_like(p_lse)
        self.merge_mod.merge_attn_states(output, p_out, p_lse, s_out, s_lse, output_lse)
        return output, output_lse

    def mla_decode(self, q, kv, *, d_v, scale, causal=False):
        dev = self.device
        b, s_q, h, d = q.shape
        paged = page_kv(kv.to(dev), self.page, seed=b * 7919 + kv.shape[1])
        rows = b * s_q
        qf = q.to(dev).reshape(rows, h, d).contiguous()
        o = torch.zeros(rows, h, d_v, dtype=q.dtype, device=dev)
        lse = torch.zeros(rows, h, dtype=torch.float32 if self.lse_fp32 else q.dtype, device=dev)
        block_table = paged.block_table.repeat_interleave(s_q, dim=0)
        seq_lens = paged.seqlens
        if s_q > 1 and causal:
            offsets = torch.arange(1 - s_q, 1, device=dev, dtype=seq_lens.dtype)
            seq_lens = (seq_lens[:, None] + offsets).flatten().clamp(min=0)
        else:
            seq_lens = seq_lens.repeat_interleave(s_q)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        splits = num_kv_splits(kv.shape[1], sms)
        attn_logits = torch.empty(rows, h, splits, d_v + 1, dtype=torch.float32, device=dev)
        cache = paged.cache.unsqueeze(2)  # [N, P, 1, 576]
        one = torch.tensor(1.0, dtype=torch.float32, device=dev)
        self.decode_mod.decode_attention_fwd(
            qf, cache, cache[..., :d_v], o, lse, block_table, seq_lens, attn_logits, splits, scale, self.page,
            k_scale=one, v_scale=one, is_mla=True,
        )  # fmt: skip
        out = o.reshape(b, s_q, h, d_v)
        return out, lse.reshape(b, s_q, h).transpose(1, 2)
