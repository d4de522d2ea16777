"""GPU: 2:4 sparse GEMM through cuSPARSELt against torch.matmul, pattern validation, serialization."""

from __future__ import annotations

import pytest

from plugin_modules import kernels, reference, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


@pytest.fixture(scope="module")
def sparse(kernels_lib):
    if not kernels_lib.sparse_available():
        pytest.fail("the kernels library was built without cuSPARSELt (pip install nvidia-cusparselt-cu13)")
    return kernels_lib


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m", [1, 7, 16, 64, 300])
@pytest.mark.parametrize("n,k", [(256, 512), (1024, 256)])
def test_matches_dense_matmul(sparse, dtype, m, n, k):
    import torch

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    w = reference.prune_24_magnitude(torch.randn(n, k, device="cuda", dtype=dt))
    x = torch.randn(m, k, device="cuda", dtype=dt)
    y = kernels.SparseGemm24(w)(x)
    ref = x.float() @ w.float().t()
    rel = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    assert rel < (2e-3 if dtype == "float16" else 1.6e-2), rel


def test_rejects_a_weight_that_is_not_24(sparse):
    import torch

    w = reference.prune_24_magnitude(torch.randn(64, 128, device="cuda", dtype=torch.float16))
    w[3, 4:8] = 1.0  # 4 nonzeros in one group
    with pytest.raises(kernels.KernelError, match=r"row 3, columns 4\.\.7"):
        kernels.SparseGemm24(w)
    with pytest.raises(kernels.KernelError, match="not 2:4"):
        kernels.check_24_device(w)


def test_rejects_unaligned_shapes(sparse):
    import torch

    w = torch.zeros(24, 128, device="cuda", dtype=torch.float16)
    with pytest.raises(kernels.KernelError, match="multiples of 16"):
        kernels.SparseGemm24(w)


def test_compressed_weight_round_trips(sparse):
    import torch

    torch.manual_seed(1)
    w = reference.prune_24_magnitude(torch.randn(128, 256, device="cuda", dtype=torch.float16))
    x = torch.randn(32, 256, device="cuda", dtype=torch.float16)
    a = kernels.SparseGemm24(w)
    blob = a.export()
    assert len(blob) < w.numel() * 2, "compressed weight should be smaller than the dense one"
    b = kernels.SparseGemm24(blob=blob)
    assert torch.equal(a(x), b(x))
    with pytest.raises(kernels.KernelError, match="header|truncated"):
        kernels.SparseGemm24(blob=b"\0" * 64)


def test_every_kernel_configuration_gives_the_product(kernels_lib):
    """Each of cuSPARSELt's kernel configurations (what the TensorRT plugin offers as tactics) gives
    the same product, at an M it pads and one it takes as is; an id outside the range is refused
    with the range named, and the object stays usable."""
    import torch

    torch.manual_seed(3)
    w = reference.prune_24_magnitude(torch.randn(256, 512, device="cuda", dtype=torch.float16))
    g = kernels.SparseGemm24(w)
    for m in (256, 37):
        x = torch.randn(m, 512, device="cuda", dtype=torch.float16)
        ref = x.float() @ w.float().t()
        count = g.algorithm_count(m)
        assert count >= 1
        for config in range(-1, count):
            g.config = config
            y = g(x)
            assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 2e-3, (m, config)
        g.config = count
        with pytest.raises(kernels.KernelError, match=r"outside \[0, "):
            g(x)
        g.config = -1
        assert ((g(x).float() - ref).abs().max() / ref.abs().max()).item() < 2e-3
