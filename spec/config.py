"""MLA dimensions and deterministic weights.

Names follow vLLM's MLA notes (``vllm/model_executor/layers/attention/mla_attention.py``, module docstring), in
the project's glossary spelling (``docs/glossary.md``; one name, one meaning)::

    D_hidden  hidden size                   7168 in DeepSeek-V3  (hidden_size)
    H_q       attention heads               128 (16 per GPU at TP8)  (num_heads)
    Lq        q latent                      1536     (q_lora_rank)
    Lkv       kv latent                     512      (kv_lora_rank)
    D_nope    nope head dim                 128      (qk_nope_head_dim)
    D_rope    rope head dim                 64       (qk_rope_head_dim)
    D_v       value head dim                128      (v_head_dim)

Weights, as matrices that multiply from the right (``x @ W``)::

    W_DQ  [D_hidden, Lq]         h_t -> q_c     (q_a_proj), then RMSNorm q_a_norm [Lq]
    W_UQ  [Lq, H_q, D_nope]      q_c -> q_nope  (q_b_proj, first D_nope of each head's D_nope + D_rope)
    W_QR  [Lq, H_q, D_rope]      q_c -> q_pe    (q_b_proj, last D_rope of each head)
    W_DKV [D_hidden, Lkv]        h_t -> kv_c    (kv_a_proj_with_mqa, first Lkv), then RMSNorm kv_a_norm [Lkv]
    W_KR  [D_hidden, D_rope]     h_t -> k_pe    (kv_a_proj_with_mqa, last D_rope; one rope key shared by all heads)
    W_UK  [Lkv, H_q, D_nope]     kv_c -> k_nope (kv_b_proj, first D_nope of each head's D_nope + D_v)
    W_UV  [Lkv, H_q, D_v]        kv_c -> v      (kv_b_proj, last D_v of each head)
    W_O   [H_q * D_v, D_hidden]  attention output -> h_t (o_proj)

vLLM stores ``W_UK_T = W_UK.permute(1, 2, 0)`` ``[H_q, D_nope, Lkv]`` and ``W_UV.transpose(0, 1)`` ``[H_q, Lkv,
D_v]`` for its batched matmuls; the spec keeps the ``[Lkv, H_q, *]`` form of the notes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .checks import finite_float, positive_int, positive_scale

__all__ = ["MLAConfig", "MLAWeights", "YarnScaling", "make_weights", "yarn_get_mscale"]


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``).

    Source: ``vllm/model_executor/layers/rotary_embedding/common.py`` (``yarn_get_mscale``). Both finite numbers,
    ``scale > 0``.
    """
    scale, mscale = positive_scale("scale", scale), finite_float("mscale", mscale)
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek's YaRN rope scaling (``rope_scaling`` in the HF config; ``deepseek_yarn`` in vLLM)."""

    factor: float = 40.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    attn_factor: float = 1.0
    extrapolation_factor: float = 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Dimensions of one MLA layer. Defaults are DeepSeek-V3's (also V3.1 and V3.2's MLA).

    ``num_heads`` is the per-GPU head count: use :meth:`tensor_parallel` for TP shards (TP8 gives 16).
    """

    hidden_size: int = 7168
    num_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = YarnScaling()
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6

    def __post_init__(self):
        for f in ("hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            positive_int(f, getattr(self, f))
        positive_int("qk_rope_head_dim", self.qk_rope_head_dim, minimum=2)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rope rotates pairs), got {self.qk_rope_head_dim}")

    @classmethod
    def deepseek_v3(cls) -> MLAConfig:
        """DeepSeek-V3 / V3.1 / V3.2 at TP1: 128 heads, the 576-wide cache entry."""
        return cls()

    @classmethod
    def tiny(cls, **overrides) -> MLAConfig:
        """A small config with the same structure (nope, rope and latent parts all present) for fast tests."""
        base = dict(
            hidden_size=64,
            num_heads=4,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            max_position_embeddings=4096,
            rope_scaling=YarnScaling(factor=4.0, original_max_position=256),
        )
        return cls(**{**base, **overrides})

    def tensor_parallel(self, tp_size: int) -> MLAConfig:
        """The per-GPU config at tensor parallel size ``tp_size`` (heads split evenly)."""
        positive_int("tp_size", tp_size)
        if self.num_heads % tp_size:
            raise ValueError(f"tp_size must divide num_heads={self.num_heads}, got {tp_size}")
        return dataclasses.replace(self, num_heads=self.num_heads // tp_size)

    @property
    def qk_head_dim(self) -> int:
        """Per-head q/k width of the compute-friendly form: ``D_nope + D_rope`` (192)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_entry_dim(self) -> int:
        """Width of one cache entry and of the absorbed form's q/k: ``Lkv + D_rope`` (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5 * mscale**2``, the same for both forms.

        Source: ``vllm/model_executor/models/deepseek_v2.py`` (``DeepseekV2MLAAttention.__init__``):
        ``self.scaling = qk_head_dim**-0.5 * mscale * mscale`` with
        ``mscale = yarn_get_mscale(factor, mscale_all_dim)``.
        For DeepSeek-V3 that is ``192**-0.5 * 1.36889**2 = 0.13523...``.
        """
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling is not None:
            m = yarn_get_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale *= m * m
        return scale


@dataclass(frozen=True)
class MLAWeights:
    """The weights of one MLA layer; shapes in the module docstring."""

    W_DQ: torch.Tensor
    q_a_norm: torch.Tensor
    W_UQ: torch.Tensor
    W_QR: torch.Tensor
    W_DKV: torch.Tensor
    kv_a_norm: torch.Tensor
    W_KR: torch.Tensor
    W_UK: torch.Tensor
    W_UV: torch.Tensor
    W_O: torch.Tensor

    def to(self, dtype: torch.dtype) -> MLAWeights:
        """All weights cast to ``dtype``."""
        return MLAWeights(**{f.name: getattr(self, f.name).to(dtype) for f in dataclasses.fields(self)})


def make_weights(config: MLAConfig, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> MLAWeights:
    """Deterministic random weights for ``config``: the same ``seed`` gives the same weights on every machine.

    Entries are normal with standard deviation ``1/sqrt(fan_in)`` so activations stay of order one; the RMSNorm
    gains are ``1 + 0.1 * normal``. Drawn in float64 on the CPU, then cast.
    """
    if not isinstance(config, MLAConfig):
        raise TypeError(f"config must be an MLAConfig, got {type(config).__name__}")
    g = torch.Generator().manual_seed(positive_int("seed", seed, minimum=0))
    c = config
    n, p, r, v = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim

    def w(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(fan_in)).to(dtype)

    def gain(size: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(size, generator=g, dtype=torch.float64)).to(dtype)

    return MLAWeights(
        W_DQ=w(c.hidden_size, c.q_lora_rank, fan_in=c.hidden_size),
        q_a_norm=gain(c.q_lora_rank),
        W_UQ=w(c.q_lora_rank, n, p, fan_in=c.q_lora_rank),
        W_QR=w(c.q_lora_rank, n, r, fan_in=c.q_lora_rank),
        W_DKV=w(c.hidden_size, c.kv_lora_rank, fan_in=c.hidden_size),
        kv_a_norm=gain(c.kv_lora_rank),
        W_KR=w(c.hidden_size, r, fan_in=c.hidden_size),
        W_UK=w(c.kv_lora_rank, n, p, fan_in=c.kv_lora_rank),
        W_UV=w(c.kv_lora_rank, n, v, fan_in=c.kv_lora_rank),
        W_O=w(n * v, c.hidden_size, fan_in=n * v),
    )
