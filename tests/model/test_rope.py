"""RoPE in HF's "rotate_half" layout against Meta's interleaved complex form.

HF's conversion script permutes each head's q/k rows so that Meta's pair
``(2i, 2i + 1)`` becomes ``(i, i + dim/2)``; rotating in either layout must
give the same vector up to that permutation, or real checkpoints would load
with scrambled positions.
"""

from __future__ import annotations

import torch

from model_svc.config import RopeScaling
from model_svc.rope import apply_rope, rope_inv_freq
from model_svc.tiny import tiny_config


def tables(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions[:, None].double() * inv_freq.double()[None]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def test_rotate_half_matches_meta_interleaved_complex() -> None:
    config = tiny_config()
    dim = config.head_dim
    inv_freq = rope_inv_freq(config, torch.float64)
    positions = torch.tensor([0, 1, 7, 300, 4000])
    x = torch.randn(positions.numel(), 3, dim, dtype=torch.float64)  # HF layout
    meta = torch.stack((x[..., : dim // 2], x[..., dim // 2 :]), dim=-1).flatten(-2)
    angles = positions[:, None, None].double() * inv_freq  # [T, 1, dim/2]
    rotated = torch.view_as_real(
        torch.view_as_complex(meta.view(*meta.shape[:-1], -1, 2))
        * torch.polar(torch.ones_like(angles), angles)
    )
    want = torch.cat((rotated[..., 0], rotated[..., 1]), dim=-1)  # back to HF layout
    torch.testing.assert_close(apply_rope(x, *tables(inv_freq, positions)), want)


def test_scores_depend_on_relative_position_only() -> None:
    inv_freq = rope_inv_freq(tiny_config(), torch.float64)
    q, k = torch.randn(1, 1, 64, dtype=torch.float64), torch.randn(1, 1, 64, dtype=torch.float64)

    def score(q_pos: int, k_pos: int) -> float:
        qr = apply_rope(q, *tables(inv_freq, torch.tensor([q_pos])))
        kr = apply_rope(k, *tables(inv_freq, torch.tensor([k_pos])))
        return float((qr * kr).sum())

    assert abs(score(10, 3) - score(110, 103)) < 1e-9
    assert abs(score(10, 3) - score(10, 4)) > 1e-6


def test_llama3_scaling_keeps_high_and_slows_low_frequencies() -> None:
    plain = rope_inv_freq(tiny_config(rope_theta=500000.0), torch.float64)
    scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    scaled = rope_inv_freq(tiny_config(rope_theta=500000.0, rope_scaling=scaling), torch.float64)
    wavelen = 2 * torch.pi / plain
    assert torch.equal(scaled[wavelen < 64 / 4], plain[wavelen < 64 / 4])
    torch.testing.assert_close(scaled[wavelen > 64], plain[wavelen > 64] / 8)
    assert ((scaled <= plain) & (scaled >= plain / 8)).all()
    linear = rope_inv_freq(tiny_config(rope_scaling=RopeScaling("linear", 4.0)), torch.float64)
    torch.testing.assert_close(linear, rope_inv_freq(tiny_config(), torch.float64) / 4)
