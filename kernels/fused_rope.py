"""Rotary embedding in one launch (Triton): the queries' roped slices and the shared key
of a batch of tokens rotated together, with the angles computed in the kernel from the
tokens' positions. The reference is `rope.rope_cos_sin` followed by `rope.apply_rope`
on each of the two, five launches and more in torch.

One program per token and block of heads: it computes the token's cos and sin (float32,
as rope_cos_sin does: position * inv_freq, times the YaRN scale) and rotates its heads'
pairs with them; the first of a token's programs rotates the key too. The result has
apply_rope's layout, pair halves split: out[:dr/2] = x1 cos - x2 sin,
out[dr/2:] = x2 cos + x1 sin, where (x1, x2) are the even and odd elements
(interleaved) or the two halves of each row.

apply_rope works in the activations' dtype: cos and sin are cast to it, and every
product, sum and difference is rounded to it by torch. The kernel computes in float32
and rounds at the same places (`round_to`), so that bf16 results are torch's, bit for
bit, up to the last bit of cos and sin themselves. (In float32 the GPU may fuse a
product into the sum: a last-bit difference.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from preload.kernels.fused_norm import round_to
from preload.kernels.launch import launcher

# Measured on an H200 inside CUDA graphs (T = 1..512, 16 and 128 heads): many small
# programs of one warp beat fewer, larger ones.
BLOCK_H = 8  # heads per program: V3's 128 heads of a token over 16 programs
NUM_WARPS = 1


@triton.jit
def _rotate(x_ptr, out_ptr, c, s, rows, n_rows, stride_row, stride_out,
            INTERLEAVED: tl.constexpr, HALF: tl.constexpr):
    """Rotate rows [R, dr] of one token by c, s [HALF] (float32, already rounded to the
    rows' dtype) and write them with pair halves split."""
    dt: tl.constexpr = x_ptr.dtype.element_ty
    i = tl.arange(0, HALF)
    first = 2 * i if INTERLEAVED else i
    second = first + 1 if INTERLEAVED else i + HALF
    live = (rows < n_rows)[:, None]
    src = x_ptr + rows[:, None] * stride_row
    x1 = tl.load(src + first[None, :], mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + second[None, :], mask=live, other=0.0).to(tl.float32)
    c, s = c[None, :], s[None, :]
    # torch: x1 * cos - x2 * sin, each product rounded, then the difference
    y1 = round_to(round_to(x1 * c, dt) - round_to(x2 * s, dt), dt)
    y2 = round_to(round_to(x2 * c, dt) + round_to(x1 * s, dt), dt)
    dst = out_ptr + rows[:, None] * stride_out + i[None, :]
    tl.store(dst, y1.to(out_ptr.dtype.element_ty), mask=live)
    tl.store(dst + HALF, y2.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _rope(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, heads, scale,
    stride_qt, stride_qh, stride_kt, stride_qot, stride_qoh, stride_kot, stride_cs,
    HAS_K: tl.constexpr, FROM_POSITIONS: tl.constexpr, INTERLEAVED: tl.constexpr,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """BLOCK_H heads of one token; the first such program of a token also rotates its key."""
    t, hb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i = tl.arange(0, HALF)
    if FROM_POSITIONS:  # rope_cos_sin's math, for this token
        angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + i)
        c, s = tl.cos(angle) * scale, tl.sin(angle) * scale
    else:
        c = tl.load(cos_ptr + t * stride_cs + i).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_cs + i).to(tl.float32)
    # apply_rope casts cos and sin to each input's dtype before multiplying.
    q_dt: tl.constexpr = q_ptr.dtype.element_ty
    _rotate(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, round_to(c, q_dt), round_to(s, q_dt),
            hb * BLOCK_H + tl.arange(0, BLOCK_H), heads, stride_qh, stride_qoh, INTERLEAVED, HALF)
    if HAS_K:
        if hb == 0:
            k_dt: tl.constexpr = k_ptr.dtype.element_ty
            _rotate(k_ptr + t * stride_kt, k_out_ptr + t * stride_kot, round_to(c, k_dt), round_to(s, k_dt),
                    tl.arange(0, 1), 1, 0, 0, INTERLEAVED, HALF)


def _as_heads(x: torch.Tensor) -> torch.Tensor:
    """[T, dr] or [T, H, dr] as [T, H, dr] (H = 1 for a key), unit stride along dr."""
    if x.dim() not in (2, 3):
        raise ValueError(f"rope inputs are [T, dr] or [T, H, dr], not {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x if x.dim() == 3 else x[:, None]


def _launch(q: torch.Tensor, k: torch.Tensor | None, interleaved: bool, positions=None, inv_freq=None,
            scale: float = 1.0, cos=None, sin=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    q3 = _as_heads(q)
    tokens, heads, dim = q3.shape
    if dim % 2 or dim & (dim - 1):
        raise ValueError(f"the rotated dimension ({dim}) must be a power of two")
    if k is not None and k.shape != (tokens, dim):
        raise ValueError(f"k {tuple(k.shape)} must be [T, dr] beside q {tuple(q.shape)}")
    k3 = _as_heads(k) if k is not None else None
    q_out = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k3.shape, dtype=k.dtype, device=k.device) if k3 is not None else q_out
    from_positions = positions is not None
    if from_positions:
        inv_freq = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()  # a no-op when kept on the device
        cos = sin = inv_freq
    else:
        if cos.shape != (tokens, dim // 2) or sin.shape != cos.shape:
            raise ValueError(f"cos/sin {tuple(cos.shape)} for {tokens} tokens of dr {dim}: [T, dr/2] expected")
        cos, sin = cos.contiguous(), sin.contiguous()
        positions = inv_freq = cos
    kk = k3 if k3 is not None else q3
    block_h = min(BLOCK_H, triton.next_power_of_2(heads))
    launcher(_rope)[(tokens, triton.cdiv(heads, block_h))](
        q3, kk, q_out, k_out, positions, inv_freq, cos, sin, heads, scale,
        q3.stride(0), q3.stride(1), kk.stride(0), q_out.stride(0), q_out.stride(1), k_out.stride(0), cos.stride(0),
        HAS_K=k3 is not None, FROM_POSITIONS=from_positions, INTERLEAVED=interleaved,
        HALF=dim // 2, BLOCK_H=block_h, num_warps=NUM_WARPS,
    )
    return q_out.view(q.shape), (k_out.view(k.shape) if k is not None else None)


def fused_rope_qk(q_pe: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  scale: float, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(apply_rope(q_pe), apply_rope(k_pe)) with rope_cos_sin(positions, inv_freq, scale),
    in one launch. q_pe [T, H, dr] and k_pe [T, dr], strided views allowed (the slices of
    the projections' outputs); positions [T] (any integer dtype); inv_freq [dr/2] float32,
    best kept on the device (a host copy is moved on every call). Returns new contiguous
    tensors, each of its input's dtype."""
    q, k = _launch(q_pe, k_pe, interleaved, positions=positions, inv_freq=inv_freq, scale=scale)
    return q, k


def fused_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float,
               interleaved: bool) -> torch.Tensor:
    """apply_rope(x, *rope_cos_sin(positions, inv_freq, scale)) in one launch, x [T, dr] or [T, H, dr]."""
    return _launch(x, None, interleaved, positions=positions, inv_freq=inv_freq, scale=scale)[0]


def fused_apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                     k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """apply_rope with cos/sin [T, dr/2] already computed (rope_cos_sin), for x [T, dr] or
    [T, H, dr] and optionally a key k [T, dr] in the same launch: (x rotated, k rotated or None)."""
    return _launch(x, k, interleaved, cos=cos, sin=sin)
