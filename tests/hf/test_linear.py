"""A decode step's linear layers through the kernel (`kvstrata.hf.linear`, `read/kernels/linear.h`)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.hf import linear
from kvstrata.hf.run import forward

kernel = linear.kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="linear_rows needs an AVX-512 build")


def _case(m, n, k, dtype, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 7, 5), (3, 64, 576), (8, 203, 100), (13, 45, 1536), (16, 4, 33)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_rows_equals_torch_within_float32_rounding(m, n, k, dtype, bias):
    x, w, b = _case(m, n, k, dtype, bias)
    got = kernel.linear_rows(x, w, b)
    assert got.dtype == dtype and got.shape == (m, n)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    # float32 sums of k products: a few ulps of the sum of magnitudes; bf16: one rounding of the output
    scale = (x.double().abs() @ w.double().abs().T) + (0 if b is None else b.double().abs())
    bound = scale * 1e-6 * k ** 0.5 + (exact.abs() * 2 ** -8 if dtype == torch.bfloat16 else 0)
    assert ((got.double() - exact).abs() <= bound + 1e-30).all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(dtype):
    """Batch invariance: what a batched step computes for a row is what the single step computes."""
    x, w, b = _case(16, 150, 200, dtype)
    alone = torch.cat([kernel.linear_rows(x[i : i + 1], w, b) for i in range(16)])
    for m in (2, 5, 8, 16):
        assert torch.equal(kernel.linear_rows(x[:m], w, b), alone[:m])
    leading = kernel.linear_rows(x.view(2, 8, 200), w, b)
    assert leading.shape == (2, 8, 150) and torch.equal(leading.view(16, 150), alone)


@needs_kernel
def test_linear_rows_refuses_what_it_cannot_compute():
    x, w, b = _case(2, 8, 16, torch.float32)
    with pytest.raises(RuntimeError, match="differ in dtype"):
        kernel.linear_rows(x.bfloat16(), w, b)
    with pytest.raises(RuntimeError, match=r"x \[..., K\]"):
        kernel.linear_rows(x[:, :8], w, b)
    with pytest.raises(RuntimeError, match="bias"):
        kernel.linear_rows(x, w, b[:4])
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        kernel.linear_rows(x.double(), w.double(), None)


@needs_kernel
def test_an_installed_model_decodes_as_torchs_linears_do_and_keeps_its_state(tiny_llama, decode_logits,
                                                                           monkeypatch):
    from kvstrata.hf import CompressedCache

    model = copy.deepcopy(tiny_llama)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    count = linear.install(model)
    assert count == sum(isinstance(m, nn.Linear) for m in model.modules()) and count > 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    ids = torch.randint(3, model.config.vocab_size, (1, 56), generator=torch.Generator().manual_seed(1))
    calls = []
    original = kernel.linear_rows
    with torch.no_grad():
        got = decode_logits(model, CompressedCache(model.config, "bf16"), ids)
        with linear.torch_linears(model):
            ref = decode_logits(model, CompressedCache(model.config, "bf16"), ids)
        # the prefill's 40 rows go to torch (its last token's logits to the kernel), a decode step's one row
        spy = type("Spy", (), {"linear_rows": lambda self, *a: calls.append(a[0].shape) or original(*a)})()
        monkeypatch.setattr(linear, "_KERNEL", [spy])
        forward(model, ids[:, :40], CompressedCache(model.config, "bf16"))
        assert calls == [torch.Size([1, 1, model.config.hidden_size])]
        calls.clear()
        forward(model, ids[:, :1], CompressedCache(model.config, "bf16"))
        assert calls and all(shape[-2] == 1 for shape in calls)
        monkeypatch.setattr(linear, "_KERNEL", [])  # a model unpickled where nothing was installed
        calls.clear()
        forward(model, ids[:, :1], CompressedCache(model.config, "bf16"))
        assert not calls
        assert copy.deepcopy(model) is not model  # nothing unpicklable hangs on the modules
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@needs_kernel
def test_training_and_large_calls_stay_on_torch(tiny_llama):
    model = copy.deepcopy(tiny_llama)
    linear.install(model)
    layer = next(m for m in model.modules() if isinstance(m, linear.RowsLinear))
    x = torch.randn(3, layer.in_features, requires_grad=True)
    y = layer(x)  # gradients enabled: torch's linear, which has a backward
    y.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    big = torch.randn(linear.ROWS + 1, layer.in_features)
    with torch.no_grad():  # a prefill's rows go to torch's GEMM: float32 as it is, bf16 summed in float32
        assert torch.equal(layer(big), F.linear(big, layer.weight, layer.bias))
        half = copy.deepcopy(layer).bfloat16()
        x = big.bfloat16()
        bias = None if half.bias is None else half.bias.float()
        want = F.linear(x.float(), half.weight.float(), bias).bfloat16()
        assert torch.equal(half(x), want)


def test_the_linear_choice_is_checked_and_torch_installs_nothing(monkeypatch, tiny_llama):
    monkeypatch.setenv("KVSTRATA_LINEAR", "fast")
    with pytest.raises(ValueError, match="KVSTRATA_LINEAR='fast'"):
        linear.chosen()
    monkeypatch.setenv("KVSTRATA_LINEAR", "torch")
    model = copy.deepcopy(tiny_llama)
    assert linear.install(model) == 0
    assert not any(isinstance(m, linear.RowsLinear) for m in model.modules())
