"""The embedding gather (kernels/embedding.py) against indexing: exact copies of the rows, for
int32 and int64 ids, a strided view of ids, a width that is not a power of two, no tokens; on
the GPU also ids past 2^31 / H rows into a large table, and replayed in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from deltaspec.kernels.embedding import embedding, embedding_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=str)
def test_embedding_rows(dtype, id_dtype, kernel_device):
    gen = torch.Generator(device=kernel_device).manual_seed(7)
    weight = torch.randn(50, 24, generator=gen, device=kernel_device).to(dtype)
    ids = torch.randint(0, 50, (2 * 9,), generator=gen, device=kernel_device).to(id_dtype)[::2]  # strided
    out = embedding(ids, weight)
    assert out.shape == (9, 24) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, embedding_reference(ids, weight))


def test_embedding_no_tokens(kernel_device):
    weight = torch.randn(8, 16, device=kernel_device)
    assert embedding(torch.zeros(0, dtype=torch.int64, device=kernel_device), weight).shape == (0, 16)


def test_embedding_rejects_bad_arguments(kernel_device):
    weight = torch.randn(8, 16, device=kernel_device)
    with pytest.raises(AssertionError, match="input_ids"):
        embedding(torch.zeros(2, 2, dtype=torch.int64, device=kernel_device), weight)
    with pytest.raises(AssertionError, match="input_ids"):
        embedding(torch.zeros(2, device=kernel_device), weight)
    with pytest.raises(AssertionError, match="contiguous"):
        embedding(torch.zeros(2, dtype=torch.int64, device=kernel_device), weight.t())


@pytest.mark.gpu
def test_embedding_gpu_large_table_and_graph():
    """A table of more than 2^31 elements (the id widened before it scales), then the gather
    captured in a CUDA graph and replayed on new ids."""
    weight = torch.randn(70_000, 32_768, device="cuda", dtype=torch.bfloat16)  # 2.3e9 elements
    ids = torch.tensor([0, 69_999, 65_600, 3], device="cuda")
    assert torch.equal(embedding(ids, weight), weight[ids])
    del weight
    table = torch.randn(248_320, 1024, device="cuda", dtype=torch.bfloat16)
    static = torch.randint(0, 248_320, (16,), device="cuda")
    embedding(static, table)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = embedding(static, table)
    for seed in range(3):
        static.copy_(torch.randint(0, 248_320, (16,), device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, table[static])
