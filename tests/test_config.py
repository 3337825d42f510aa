import math

import pytest
import torch

from mlaspec.spec.config import MLAConfig, make_weights


def test_deepseek_v3_dimensions_and_scale():
    c = MLAConfig.deepseek_v3()
    assert (c.hidden_size, c.num_heads, c.q_lora_rank, c.kv_lora_rank) == (7168, 128, 1536, 512)
    assert (c.qk_head_dim, c.kv_entry_dim, c.v_head_dim) == (192, 576, 128)
    # deepseek_v2.py: scaling = qk_head_dim**-0.5 * mscale**2, mscale = 0.1 * mscale_all_dim * ln(factor) + 1
    assert c.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert MLAConfig.tiny(rope_scaling=None).softmax_scale == pytest.approx(MLAConfig.tiny().qk_head_dim ** -0.5)


def test_tensor_parallel():
    assert MLAConfig().tensor_parallel(8).num_heads == 16
    with pytest.raises(ValueError, match="tp_size must divide num_heads=128"):
        MLAConfig().tensor_parallel(3)


def test_weights_are_deterministic_and_shaped():
    c = MLAConfig.tiny()
    a, b, other = make_weights(c, seed=7), make_weights(c, seed=7), make_weights(c, seed=8)
    assert torch.equal(a.W_UK, b.W_UK) and not torch.equal(a.W_UK, other.W_UK)
    assert a.W_UK.shape == (c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim)
    assert a.W_O.shape == (c.num_heads * c.v_head_dim, c.hidden_size)
    assert make_weights(c, dtype=torch.bfloat16).W_DQ.dtype == torch.bfloat16


def test_bad_config():
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        MLAConfig.tiny(qk_rope_head_dim=7)
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        MLAConfig.tiny(num_heads=0)
    with pytest.raises(TypeError, match="kv_lora_rank must be an int"):
        MLAConfig.tiny(kv_lora_rank=3.5)
    with pytest.raises(TypeError, match="config must be an MLAConfig"):
        make_weights({})
