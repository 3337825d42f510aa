"""DeepSeek YaRN rope: rotation, relative-position property, YaRN ramp boundaries, the two pair styles."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mlaspec.spec.config import MLAConfig, YarnScaling
from mlaspec.spec.rope import apply_rope, inv_freq

CONFIGS = [MLAConfig.tiny(), MLAConfig.tiny(rope_scaling=None), MLAConfig()]


def test_deepseek_v3_yarn_ramp():
    # rotary_embedding/common.py yarn_find_correction_range with beta_fast=32, beta_slow=1, dim=64, base=1e4,
    # original max 4096 gives low=10, high=23: pairs up to 10 keep the original frequency, pairs from 23 on are
    # interpolated by the factor 40, and the ramp blends the ones in between.
    c = MLAConfig.deepseek_v3()
    base = 1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    f = inv_freq(c)
    torch.testing.assert_close(f[:11], base[:11], rtol=0, atol=0)
    torch.testing.assert_close(f[23:], base[23:] / 40, rtol=1e-15, atol=0)
    assert ((f[11:23] < base[11:23]) & (f[11:23] > base[11:23] / 40)).all()


def test_no_scaling_is_plain_rope():
    c = MLAConfig.tiny(rope_scaling=None)
    r = c.qk_rope_head_dim
    torch.testing.assert_close(inv_freq(c), 1.0 / c.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r))


def test_gptj_rotates_adjacent_pairs():
    c = MLAConfig.tiny(rope_scaling=None)
    x = torch.zeros(1, c.qk_rope_head_dim, dtype=torch.float64)
    x[0, 0] = 1.0  # pair 0 = (x0, x1), angle = pos * 1
    y = apply_rope(x, torch.tensor([3]), c)
    assert y[0, 0].item() == pytest.approx(math.cos(3)) and y[0, 1].item() == pytest.approx(math.sin(3))
    z = apply_rope(x, torch.tensor([3]), c, style="neox")  # neox pairs (x0, x_{D_rope/2})
    assert z[0, c.qk_rope_head_dim // 2].item() == pytest.approx(math.sin(3))


@pytest.mark.parametrize("config", CONFIGS, ids=["tiny", "tiny-noyarn", "v3"])
@pytest.mark.parametrize("style", ["gptj", "neox"])
@given(m=st.integers(0, 5000), n=st.integers(0, 5000), shift=st.integers(0, 5000))
def test_dot_product_depends_only_on_relative_position(config, style, m, n, shift):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, config.qk_rope_head_dim, generator=g, dtype=torch.float64)
    dot = lambda a, b: (
        apply_rope(q[None], torch.tensor([a]), config, style=style)
        @ apply_rope(k[None], torch.tensor([b]), config, style=style).T
    ).item()
    assert dot(m, n) == pytest.approx(dot(m + shift, n + shift), rel=1e-9, abs=1e-9)


@given(st.integers(0, 10**5))
def test_rotation_preserves_norm_when_mscale_is_one(pos):
    c = MLAConfig()
    x = torch.randn(2, 3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(pos % 97))
    y = apply_rope(x, torch.tensor([pos, pos + 1]), c)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_gptj_equals_neox_on_deinterleaved_input():
    c = MLAConfig.tiny()
    r = c.qk_rope_head_dim
    perm = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])  # interleaved -> halves
    x, pos = torch.randn(5, 2, r, dtype=torch.float64), torch.arange(5) * 7
    torch.testing.assert_close(apply_rope(x, pos, c)[..., perm], apply_rope(x[..., perm], pos, c, style="neox"))


def test_attn_factor_scales_cos_sin():
    c = MLAConfig.tiny(rope_scaling=YarnScaling(factor=4.0, original_max_position=256, mscale=2.0, mscale_all_dim=1.0))
    x = torch.randn(3, c.qk_rope_head_dim, dtype=torch.float64)
    m = (0.1 * 2.0 * math.log(4) + 1) / (0.1 * 1.0 * math.log(4) + 1)
    torch.testing.assert_close(apply_rope(x, torch.zeros(3, dtype=torch.int64), c), x * m)


def test_bad_input():
    c = MLAConfig.tiny()
    x = torch.randn(3, c.qk_rope_head_dim)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        apply_rope(x, torch.tensor([0, -1, 2]), c)
    with pytest.raises(ValueError, match="positions must have shape"):
        apply_rope(x, torch.arange(4), c)
    with pytest.raises(ValueError, match="x must have shape"):
        apply_rope(torch.randn(3, 5), torch.arange(3), c)
    with pytest.raises(TypeError, match="positions must have dtype"):
        apply_rope(x, torch.arange(3.0), c)
    with pytest.raises(ValueError, match="style"):
        apply_rope(x, torch.arange(3), c, style="llama")
