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
  calls it: the paged cache ``[NB, P, 1, 576]`` as the keys and its first 512 columns as the values, one program per
  query row, causal multi-token decode expressed as per-row lengths ``seq_len - S_q + 1 + t`` (clamped at 0), the
  block table repeated per row, ``num_kv_splits = min(next_pow2(max(1, max_seq_len // 512)), 2 * SMs)``.
  **vLLM allocates the LSE in the query dtype** (``lse = torch.zeros(B, H, dtype=q.dtype)``), so in bf16 the LSE
  is rounded to 8 bits; the adapter does the same by default (what vLLM returns for DCP merges) and
  ``MLASPEC_VLLM_LSE_FP32=1`` gives the kernel an fp32 buffer instead.

* ``split_decodes_and_prefills``, ``reorder_batch_to_split_decodes_and_prefills``,
  ``make_local_attention_virtual_batches`` -> vLLM 0.33's own functions of the same names in
  ``vllm/v1/attention/backends/utils.py``. That file imports half of vLLM (config, logger, distributed, Triton), but
  the three functions use only numpy, torch, ``cdiv``, ``async_tensor_h2d``, ``gpu_sync_allowed`` and the
  ``CommonAttentionMetadata`` dataclass. So :func:`load_vllm_utils` executes ``utils.py`` -- and
  ``vllm/v1/attention/backend.py``, which defines the real ``CommonAttentionMetadata`` -- under a *fake* ``vllm``
  package that exists only during the load: every other ``vllm.*`` module is a stand-in whose every name is an inert
  placeholder, except those one-line helpers (``cdiv(a, b) = -(a // -b)``, ``async_tensor_h2d`` as a plain copy
  to the device, ``gpu_sync_allowed`` a no-op context, as in ``vllm/utils/{math,torch}_utils.py`` and
  ``gpu_sync_debug.py``). The spec's metadata is translated into vLLM's dataclass field by field
  (:func:`to_vllm_metadata`); the reorder runs on a stand-in ``InputBatch`` / ``SchedulerOutput`` that records
  ``swap_states``. These run on CPU: no CUDA and no Triton are needed.

  Outputs vLLM does not return are reconstructed from what it does, and say so: the reorder's ``order`` is the
  stand-in batch's request ids after vLLM's swaps, its ``regions`` are the spec's labels of that order (so a
  classification that differs from the spec's shows as a non-sorted or mismatching row), ``modified`` is vLLM's
  return value; the local batches' ``k_seqstarts_absolute`` (internal to vLLM) is recovered from the returned
  ``query_start_loc_cpu`` and ``seq_lens`` (``k_start = q_first + seqlens_q - seqlens_k``). vLLM 0.33 has only the
  four-region reorder, so the seed's two-region cases are skipped.

The Triton ops run on CUDA, or on CPU under the Triton interpreter (``TRITON_INTERPRET=1``, tiny cases only); the
metadata ops run anywhere. The backend is usable when either group is; :meth:`VLLMBackend.unsupported` names the
missing piece per op.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import numpy as np
import torch

from mlaspec.spec.batch import CommonAttentionMetadata as SpecMetadata
from mlaspec.spec.batch import Request, request_region

from .common import DCPByRanks, importable, page_kv

__all__ = ["VLLMBackend", "find_vllm_source", "load_vllm_file", "load_vllm_utils", "to_vllm_metadata"]

OPS_DIR = "vllm/v1/attention/ops"
FILES = ("triton_merge_attn_states.py", "triton_decode_attention.py")
UTILS = "vllm/v1/attention/backends/utils.py"
BACKEND = "vllm/v1/attention/backend.py"  # defines CommonAttentionMetadata
SOURCES = (*(f"{OPS_DIR}/{f}" for f in FILES), UTILS, BACKEND)
KERNEL_OPS = frozenset({"merge_attn_states", "mla_decode", "dcp_decode"})
METADATA_OPS = frozenset(
    {
        "split_decodes_and_prefills",
        "reorder_batch_to_split_decodes_and_prefills",
        "make_local_attention_virtual_batches",
    }
)
_MIN_WORK_PER_SPLIT = 512  # vllm/v1/attention/backends/mla/triton_mla.py
_SPLIT_OCCUPANCY_MULTIPLIER = 2


def find_vllm_source() -> Path:
    """The folder that holds ``vllm/v1/attention/{ops,backends}/`` (see the module docstring), or ``ImportError``."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    for root in list(spec.submodule_search_locations or []) if spec else []:
        if any((Path(root).parent / f).exists() for f in SOURCES):
            return Path(root).parent
    given = os.environ.get("MLASPEC_VLLM_WHEEL_DIR")
    if not given:
        raise ImportError(
            "vllm's source files not found: no importable vllm with vllm/v1/attention, and MLASPEC_VLLM_WHEEL_DIR "
            "is not set (point it at an unzipped vllm 0.33 wheel, at the .whl, or at a folder holding it)"
        )
    path = Path(given)
    if any((path / f).exists() for f in SOURCES):
        return path
    wheels = [path] if path.suffix == ".whl" else sorted(path.glob("vllm-*.whl")) if path.is_dir() else []
    if not wheels:
        names = ", ".join(SOURCES)
        raise ImportError(f"MLASPEC_VLLM_WHEEL_DIR={given} holds neither vLLM's sources ({names}) nor a vllm-*.whl")
    out = Path(tempfile.mkdtemp(prefix="mlaspec-vllm-"))
    with zipfile.ZipFile(wheels[0]) as z:
        names = set(z.namelist())
        for f in SOURCES:
            if f in names:
                z.extract(f, out)
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
        is_device_capability_family=lambda family: (
            torch.cuda.is_available() and torch.cuda.get_device_capability()[0] * 10 == family
        ),
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
            if k == "vllm" or not importable(k):
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


# -- a fake vllm package, for loading utils.py without vLLM's dependencies -------------------------------------------
class _PlaceholderMeta(type):
    def __getattr__(cls, name):  # KVCacheLayout.LBNHC and the like, read at import time
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __getitem__(cls, item):  # Generic[...] subscripts
        return cls

    def __or__(cls, other):  # ``X | None`` annotations
        return cls

    __ror__ = __or__


class _Placeholder(metaclass=_PlaceholderMeta):
    """Any name of a stand-in module: a class that accepts any call, attribute, subscript or base-class use."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):  # decorators with arguments (``@triton.jit(...)``), loggers
        return self

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, cls)
        return cls


def _h2d(data, device=None, dtype=None, out=None):
    """``vllm/utils/torch_utils.py`` ``async_tensor_h2d`` without pinned memory: a copy to ``device``."""
    t = torch.from_numpy(data) if isinstance(data, np.ndarray) else torch.as_tensor(data, dtype=dtype)
    if out is not None:
        return out.copy_(t)
    return t.to(device)


_HELPERS = {  # the only vLLM names the three metadata functions call, as vLLM 0.33 defines them
    "vllm.utils.math_utils": {"cdiv": lambda a, b: -(a // -b), "round_down": lambda a, b: a // b * b},
    "vllm.utils.gpu_sync_debug": {"gpu_sync_allowed": lambda first_only=False: contextlib.nullcontext()},
    "vllm.utils.torch_utils": {"PIN_MEMORY": False, "async_tensor_h2d": _h2d},
}


class _FakeVLLM(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every ``vllm.*`` module: the given source files as themselves, everything else as a stand-in."""

    def __init__(self, files: dict[str, Path]):
        self.files = files

    def find_spec(self, name, path=None, target=None):
        if name != "vllm" and not name.startswith("vllm."):
            return None
        if name in self.files:
            return importlib.util.spec_from_file_location(name, self.files[name])
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        for k, v in _HELPERS.get(spec.name, {}).items():
            setattr(module, k, v)
        return module

    def exec_module(self, module):
        pass


def load_vllm_utils(root: Path) -> types.ModuleType:
    """``vllm/v1/attention/backends/utils.py`` from ``root``, executed under a fake ``vllm`` package.

    The fake package is on ``sys.meta_path`` and in ``sys.modules`` only during the load (any ``vllm`` modules
    already imported are restored afterwards). ``CommonAttentionMetadata`` is the real dataclass, from
    ``backend.py`` executed the same way. ``ImportError`` if either file is missing.
    """
    root = Path(root)
    for f in (UTILS, BACKEND):
        if not (root / f).exists():
            raise ImportError(f"{root} has no {f} (unzip it from the vllm 0.33 wheel)")
    files = {"vllm.v1.attention.backends.utils": root / UTILS, "vllm.v1.attention.backend": root / BACKEND}
    is_vllm = lambda k: k == "vllm" or k.startswith("vllm.")  # noqa: E731
    saved = {k: m for k, m in sys.modules.items() if is_vllm(k)}
    for k in saved:
        del sys.modules[k]
    finder = _FakeVLLM(files)
    sys.meta_path.insert(0, finder)
    try:
        module = importlib.import_module("vllm.v1.attention.backends.utils")
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if is_vllm(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
    return module


def to_vllm_metadata(utils: types.ModuleType, m: SpecMetadata):
    """The spec's :class:`~mlaspec.spec.batch.CommonAttentionMetadata` as vLLM 0.33's dataclass of that name.

    Field by field (``vllm/v1/attention/backend.py``): ``query_start_loc`` (and its ``_cpu`` copy) int32,
    ``seq_lens`` int32 (also as ``seq_lens_cpu_upper_bound``, exact outside async speculative decoding),
    ``block_table_tensor`` int32, ``slot_mapping`` int64, ``is_prefilling`` bool, the scalars
    ``num_reqs``, ``num_actual_tokens``, ``max_query_len``, ``max_seq_len``, ``causal=True``.
    """
    qsl = m.query_start_loc.to(torch.int32)
    seq_lens = m.seq_lens.to(torch.int32)
    return utils.CommonAttentionMetadata(
        query_start_loc=qsl.clone(),
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens.clone(),
        num_reqs=m.num_reqs,
        num_actual_tokens=m.num_actual_tokens,
        max_query_len=m.max_query_len,
        max_seq_len=m.max_seq_len,
        block_table_tensor=m.block_table.to(torch.int32).clone(),
        slot_mapping=m.slot_mapping.to(torch.int64).clone(),
        causal=True,
        is_prefilling=m.is_prefilling.to(torch.bool).clone(),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )


class _InputBatch:
    """The three arrays and ``swap_states`` that vLLM's reorder reads from ``gpu_input_batch.InputBatch``."""

    def __init__(self, requests: list[Request]):
        self.req_ids = [str(i) for i in range(len(requests))]
        self.num_computed_tokens_cpu = np.array([r.context_len for r in requests], dtype=np.int32)
        # prompt_len None: the prompt is consumed once there is context (the spec's rule); any value <= context
        self.num_prompt_tokens = np.array(
            [r.prompt_len if r.prompt_len is not None else max(r.context_len, 1) for r in requests], dtype=np.int32
        )
        self.swaps: list[tuple[int, int]] = []

    def swap_states(self, i: int, j: int) -> None:
        self.req_ids[i], self.req_ids[j] = self.req_ids[j], self.req_ids[i]
        for a in (self.num_computed_tokens_cpu, self.num_prompt_tokens):
            a[[i, j]] = a[[j, i]]
        self.swaps.append((i, j))


def num_kv_splits(max_seq_len: int, sm_count: int) -> int:
    """``min(next_pow2(max(1, max_seq_len // 512)), 2 * SMs)`` (``triton_mla.py`` ``_compute_num_kv_splits``)."""
    ideal = 1 << (max(1, max_seq_len // _MIN_WORK_PER_SPLIT) - 1).bit_length()
    return min(ideal, sm_count * _SPLIT_OCCUPANCY_MULTIPLIER)


class VLLMBackend(DCPByRanks):
    """vLLM 0.33's Triton kernels and batch-metadata helpers (see the module docstring)."""

    name = "vllm"
    ops = KERNEL_OPS | METADATA_OPS
    jit = True  # its MLA decode and merge are Triton kernels, compiled on first use
    dtypes = frozenset({"bfloat16", "float16", "float32"})

    def __init__(self, device: str | None = None):
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        self.kernel_reason: str | None = None
        self.metadata_reason: str | None = None
        if device:
            self.device = torch.device(device)
        elif torch.cuda.is_available():
            self.device = torch.device(os.environ.get("MLASPEC_DEVICE", "cuda"))
        else:
            self.device = torch.device("cpu")
            if not interpret:
                self.kernel_reason = "vllm's Triton kernels need CUDA (or TRITON_INTERPRET=1 for tiny CPU runs)"
        where = []
        try:  # an installed vLLM first
            self.utils = importlib.import_module("vllm.v1.attention.backends.utils")
            where.append("metadata helpers from installed vllm")
        except Exception:
            self.utils = None
        root = None
        try:
            root = find_vllm_source()
        except ImportError as exc:
            source_error = str(exc)
        if self.utils is None:
            try:
                if root is None:
                    raise ImportError(source_error)
                self.utils = load_vllm_utils(root)
                where.append(f"metadata helpers from {root}/{UTILS}")
            except Exception as exc:
                self.metadata_reason = f"vLLM's metadata helpers not loaded: {type(exc).__name__}: {exc}"
        if self.kernel_reason is None:
            self.kernel_reason = self._load_kernels(root, where)
        if self.kernel_reason and self.metadata_reason:
            raise RuntimeError(f"{self.kernel_reason}; {self.metadata_reason}")
        self.lse_fp32 = os.environ.get("MLASPEC_VLLM_LSE_FP32") == "1"
        self.page = int(os.environ.get("MLASPEC_VLLM_PAGE", "64"))
        self.version = "vllm " + ", ".join(where) + (" (fp32 LSE)" if self.lse_fp32 else "")
        # vLLM's own buffer holds the LSE in the query dtype: declared (mlaspec.conformance.numerics)
        self.numerics = {} if self.lse_fp32 else dict.fromkeys(("mla_decode", "dcp_decode"), ("lse_in_query_dtype",))

    def _load_kernels(self, root: Path | None, where: list[str]) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return f"triton not installed: {exc}"
        try:
            self.merge_mod = importlib.import_module("vllm.v1.attention.ops.triton_merge_attn_states")
            self.decode_mod = importlib.import_module("vllm.v1.attention.ops.triton_decode_attention")
            where.append("Triton kernels from installed vllm")
            return None
        except Exception:
            pass
        if root is None or not all((root / OPS_DIR / f).exists() for f in FILES):
            return f"vllm's Triton files ({OPS_DIR}/{', '.join(FILES)}) not found"
        self.merge_mod = load_vllm_file(root, f"{OPS_DIR}/{FILES[0]}")
        self.decode_mod = load_vllm_file(root, f"{OPS_DIR}/{FILES[1]}")
        where.append(f"Triton kernels from {root}")
        return None

    def unsupported(self, case) -> str | None:
        if case.op in KERNEL_OPS:
            return self.kernel_reason
        if case.op in METADATA_OPS and self.metadata_reason:
            return self.metadata_reason
        if case.op == "reorder_batch_to_split_decodes_and_prefills" and case.params.get("regions", 4) != 4:
            return (
                "vLLM 0.33's reorder has four regions (decode / short extend / long extend / prefill); "
                "regions=2 is the seed's version"
            )
        return None

    # -- Triton kernels ------------------------------------------------------------------------------------------
    def merge_attn_states(self, prefix_output, prefix_lse, suffix_output, suffix_lse):
        dev = self.device
        p_out, s_out = prefix_output.to(dev).contiguous(), suffix_output.to(dev).contiguous()
        p_lse, s_lse = prefix_lse.to(dev, torch.float32), suffix_lse.to(dev, torch.float32)
        output = torch.empty_like(p_out)
        output_lse = torch.empty_like(p_lse)
        self.merge_mod.merge_attn_states(output, p_out, p_lse, s_out, s_lse, output_lse)
        return output, output_lse

    def mla_decode(self, q, kv, *, d_v, scale, causal=False, seq_lens=None):
        dev = self.device
        b, s_q, h, d = q.shape
        paged = page_kv(kv.to(dev), self.page, seqlens=seq_lens, seed=b * 7919 + kv.shape[1])
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
        cache = paged.cache.unsqueeze(2)  # [NB, P, 1, 576]
        one = torch.tensor(1.0, dtype=torch.float32, device=dev)
        self.decode_mod.decode_attention_fwd(
            qf,
            cache,
            cache[..., :d_v],
            o,
            lse,
            block_table,
            seq_lens,
            attn_logits,
            splits,
            scale,
            self.page,
            k_scale=one,
            v_scale=one,
            is_mla=True,
        )
        out = o.reshape(b, s_q, h, d_v)
        return out, lse.reshape(b, s_q, h).transpose(1, 2)

    # -- batch metadata (CPU) ------------------------------------------------------------------------------------
    def split_decodes_and_prefills(
        self, metadata, decode_threshold=1, require_uniform=False, treat_short_extends_as_decodes=True
    ):
        cam = to_vllm_metadata(self.utils, metadata)
        got = self.utils.split_decodes_and_prefills(
            cam, decode_threshold, require_uniform, treat_short_extends_as_decodes
        )
        return tuple(int(x) for x in got)

    def reorder_batch_to_split_decodes_and_prefills(self, requests, decode_threshold=1, *, regions=4):
        if regions != 4:
            raise ValueError(f"regions must be 4 for vLLM 0.33 (its only reorder), got {regions!r}")
        batch = _InputBatch(list(requests))
        sched = types.SimpleNamespace(num_scheduled_tokens={str(i): r.new_tokens for i, r in enumerate(requests)})
        modified = bool(self.utils.reorder_batch_to_split_decodes_and_prefills(batch, sched, decode_threshold))
        order = tuple(int(i) for i in batch.req_ids)
        labels = tuple(request_region(requests[i], decode_threshold, 4) for i in order)
        return order, labels, modified

    def make_local_attention_virtual_batches(self, attn_chunk_size, metadata, block_size=None):
        cam = to_vllm_metadata(self.utils, metadata)
        p = metadata.block_size if block_size is None else block_size
        local, _ = self.utils.make_local_attention_virtual_batches(attn_chunk_size, cam, p)
        cu = local.query_start_loc_cpu.to(torch.int64)
        seqlens_q = (cu[1:] - cu[:-1]).to(torch.int32)
        seqlens_k = local.seq_lens.cpu()
        # k_seqstarts_absolute is internal to vLLM: the virtual request's first query token is token cu[v] of the
        # batch, i.e. position context_b + cu[v] - query_start_loc[b] of real request b; its keys end with it.
        qsl = metadata.query_start_loc.to(torch.int64)
        req = torch.searchsorted(qsl, cu[:-1], right=True) - 1
        q_first = metadata.num_computed_tokens.to(torch.int64)[req] + cu[:-1] - qsl[req]
        k_starts = (q_first + seqlens_q.to(torch.int64) - seqlens_k.to(torch.int64)).to(torch.int32)
        return seqlens_q, local.query_start_loc_cpu, seqlens_k, local.block_table_tensor.cpu(), k_starts
