"""The two forms of MLA attention compute the same thing."""

import torch

from preload.kernels.attention import mla_absorbed, mla_expanded


def test_absorbed_equals_expanded():
    gen = torch.Generator().manual_seed(0)
    b, q, k, h, dn, dr, dv, r = 3, 5, 9, 4, 16, 8, 12, 24
    args = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in
            [(b, q, h, dn), (b, q, h, dr), (b, k, r), (b, k, dr), (h * (dn + dv), r)]]
    mask = torch.rand(b, q, k, generator=gen) < 0.6
    mask[..., 0] = True
    out = mla_expanded(*args, mask, 0.3)
    assert out.shape == (b, q, h, dv)
    assert torch.allclose(out, mla_absorbed(*args, mask, 0.3), atol=1e-10)


def test_masked_keys_do_not_contribute():
    gen = torch.Generator().manual_seed(1)
    q_nope, q_pe = torch.randn(1, 1, 2, 4, generator=gen), torch.randn(1, 1, 2, 2, generator=gen)
    c_kv, k_pe, kv_b = torch.randn(1, 3, 5, generator=gen), torch.randn(1, 3, 2, generator=gen), torch.randn(2 * 7, 5, generator=gen)
    mask = torch.tensor([[[True, True, False]]])
    a = mla_absorbed(q_nope, q_pe, c_kv, k_pe, kv_b, mask, 1.0)
    c_kv[0, 2] += 100.0
    assert torch.equal(a, mla_absorbed(q_nope, q_pe, c_kv, k_pe, kv_b, mask, 1.0))
