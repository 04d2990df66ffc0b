"""The head error on low-precision heads and vocabulary chunking, against float64 autograd."""

import pytest
import torch
import torch.nn.functional as F

from loca.core.head import LogitTransform, head_loss_and_error

pytestmark = pytest.mark.unit


def reference(hn, w, b, y, transform, logits_dtype=torch.float64):
    """Autograd in float64; ``logits_dtype`` rounds the head's matmul output the way a
    low-precision model's own forward does."""
    hn = hn.double().detach().requires_grad_(True)
    z = (hn @ w.double().T).to(logits_dtype).double() + (b.double() if b is not None else 0)
    z = z * transform.scale
    if transform.softcap:
        z = transform.softcap * torch.tanh(z / transform.softcap)
    loss = F.cross_entropy(z, y, reduction="none")
    (grad,) = torch.autograd.grad(loss.sum(), hn)
    return loss.detach(), grad


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(0.5), LogitTransform(1.0, 3.0)])
@pytest.mark.parametrize("chunk", [7, None])
def test_full_precision_head_is_exact(transform, chunk):
    gen = torch.Generator().manual_seed(0)
    hn, w = torch.randn(9, 16, generator=gen), torch.randn(50, 16, generator=gen)
    b, y = torch.randn(50, generator=gen), torch.randint(0, 50, (9,), generator=gen)
    loss, e = head_loss_and_error(hn.double(), w.double(), b.double(), y, transform, vocab_chunk=chunk)
    want_loss, want_e = reference(hn, w, b, y, transform)
    torch.testing.assert_close(loss, want_loss, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(e, want_e, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(1.0, 3.0)])
def test_low_precision_head_keeps_small_errors_of_confident_predictions(dtype, transform):
    """With a confident model (p_y ≈ 0.99+) the error is a tiny fraction of |W_y|. Forming
    softmax − onehot in float32 before the low-precision matmul keeps it accurate to a few
    percent; subtracting W_y after a rounded matmul (the naive order) gives ~100% error here."""
    gen = torch.Generator().manual_seed(1)
    d, v, n = 32, 300, 12
    w = torch.randn(v, d, generator=gen).to(dtype)
    y = torch.randint(0, v, (n,), generator=gen)
    hn = (0.6 * w[y].float() + 0.05 * torch.randn(n, d, generator=gen)).to(dtype)
    loss, e = head_loss_and_error(hn, w, None, y, transform, vocab_chunk=64)
    want_loss, want_e = reference(hn, w, None, y, transform, logits_dtype=dtype)
    if transform.softcap is None:
        assert float(torch.exp(-want_loss).median()) > 0.99  # the predictions are confident
    rel = (e.double() - want_e).norm(dim=1) / want_e.norm(dim=1)
    assert float(rel.median()) < 0.01 and float(rel.max()) < 0.1
    torch.testing.assert_close(loss.double(), want_loss, atol=0.05, rtol=0.02)


def test_loss_only_skips_the_error():
    hn, w, y = torch.randn(3, 8), torch.randn(20, 8), torch.tensor([1, 2, 3])
    loss, e = head_loss_and_error(hn, w, None, y, need_error=False)
    assert e is None and loss.shape == (3,)


@pytest.mark.parametrize("bias", [False, True])
def test_low_precision_error_does_not_depend_on_the_chunking(bias):
    """While the N×V logits fit WHOLE_BYTES, each pass is one matmul and the chunks only split
    the float32 work: any chunking gives the one-chunk result (float32 rounding aside). Beyond it,
    each chunk's error is rounded to the head's dtype on its own (a few bf16 ulps)."""
    import loca.core.head as head

    gen = torch.Generator().manual_seed(2)
    w = torch.randn(300, 24, generator=gen).to(torch.bfloat16)
    hn = torch.randn(10, 24, generator=gen).to(torch.bfloat16)
    b = torch.randn(300, generator=gen).to(torch.bfloat16) if bias else None
    y = torch.randint(0, 300, (10,), generator=gen)
    one_loss, one_e = head_loss_and_error(hn, w, b, y, vocab_chunk=300)
    want_loss, want_e = reference(hn, w, b, y, LogitTransform(), logits_dtype=torch.bfloat16)
    torch.testing.assert_close(one_e.double(), want_e, atol=0.02, rtol=0.02)
    for chunk in (64, 299):
        loss, e = head_loss_and_error(hn, w, b, y, vocab_chunk=chunk)
        torch.testing.assert_close(loss, one_loss, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(e, one_e, atol=1e-6, rtol=1e-6)
        old, head.WHOLE_BYTES = head.WHOLE_BYTES, 0  # a matmul per chunk, as for a large N×V
        try:
            loss, e = head_loss_and_error(hn, w, b, y, vocab_chunk=chunk)
        finally:
            head.WHOLE_BYTES = old
        torch.testing.assert_close(loss, one_loss, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(e.double(), want_e, atol=0.05, rtol=0.05)
