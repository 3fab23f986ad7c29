"""Rotary positions (the rotate-half layout), shared by the decoder's attention and its copy
head."""

from __future__ import annotations

import torch
from torch import Tensor


def rope_tables(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin of rotary angles for integer positions. (...,) -> (..., head_dim) each."""
    half = head_dim // 2
    inv = theta ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angle = positions.to(torch.float32).unsqueeze(-1) * inv  # (..., half)
    angle = torch.cat([angle, angle], dim=-1)  # (..., head_dim), the rotate_half layout
    return torch.cos(angle), torch.sin(angle)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding: x (K, H, N, hd) with cos/sin broadcastable to it."""
    a, b = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-b, a], dim=-1) * sin.to(x.dtype)
