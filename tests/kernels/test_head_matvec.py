"""Each head's vector times its own matrix (Triton) gives the einsum it replaces, for
both products of MLA's absorbed form: W_uk read transposed (its K strided), W_uv as
stored (its K contiguous); edges that fill neither a block of columns nor of K."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_cases import DEVICE  # noqa: E402

from preload.kernels.head_matvec import ROWS, WIDE_ROWS, head_matvec  # noqa: E402


def kv_b(heads: int, dn: int, dv: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W_uk [H, dn, r] and W_uv [H, dv, r] as views of one kv_b, as attention.absorbed_weights cuts them."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(heads * (dn + dv), rank, generator=gen) * 0.05).to(torch.bfloat16).to(DEVICE)
    w = w.unflatten(0, (heads, -1))
    return w[:, :dn], w[:, dn:]


# One tile of rows, then tiles of WIDE_ROWS (a serving batch's: the last one partial).
@pytest.mark.parametrize("batch", [1, 5, ROWS, ROWS + 1, WIDE_ROWS + 3])
def test_both_absorbed_products_equal_the_einsum(batch):
    heads, dn, dv, rank = 3, 48, 40, 160  # K of 48 and 160, N of 160 and 40: partial blocks everywhere
    w_uk, w_uv = kv_b(heads, dn, dv, rank)
    gen = torch.Generator().manual_seed(1)
    q_nope = torch.randn(batch, heads, dn, generator=gen).to(torch.bfloat16).to(DEVICE)
    latent = torch.randn(batch, heads, rank, generator=gen).to(torch.bfloat16).to(DEVICE)
    for x, w, want in ((q_nope, w_uk.transpose(1, 2), torch.einsum("bhd,hdr->bhr", q_nope.float(), w_uk.float())),
                       (latent, w_uv, torch.einsum("bhr,hvr->bhv", latent.float(), w_uv.float()))):
        got = head_matvec(x, w)
        assert got.shape == want.shape and got.dtype == x.dtype
        assert torch.allclose(got.float(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2), (got.float() - want).abs().max()


def test_the_output_is_contiguous_and_a_strided_k_is_refused():
    w_uk, _ = kv_b(2, 32, 32, 64)
    x = torch.randn(ROWS + 2, 2, 32).to(torch.bfloat16).to(DEVICE)
    assert head_matvec(x, w_uk.transpose(1, 2)).is_contiguous()  # (the einsum's is a transposed view)
    with pytest.raises(ValueError, match="contiguous"):
        head_matvec(x.transpose(0, 2).contiguous().transpose(0, 2), w_uk.transpose(1, 2))


def test_it_writes_into_given_rows_of_a_wider_output_and_nowhere_else():
    """A mixed step's decode rows write their attention straight into the step's output
    [T, H, dv] (deepseek.paged_attention): the first rows of it, N contiguous, rows apart."""
    _, w_uv = kv_b(2, 32, 48, 64)
    latent = torch.randn(5, 2, 64).to(torch.bfloat16).to(DEVICE)
    step = torch.full((9, 2, 48), 7.0, dtype=torch.bfloat16, device=DEVICE)
    got = head_matvec(latent, w_uv, step[:5])
    assert got.data_ptr() == step.data_ptr()
    want = torch.einsum("bhr,hvr->bhv", latent.float(), w_uv.float())
    assert torch.allclose(step[:5].float(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)
    assert (step[5:] == 7.0).all()
    with pytest.raises(ValueError, match=r"\[5, 2, 48\]"):
        head_matvec(latent, w_uv, step[:4])
