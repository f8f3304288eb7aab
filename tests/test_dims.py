"""A model's dimensions: the FLOP counter the benchmarks share (the memory estimate's tests are in test_buckets)."""

from jaxserve.dims import ModelDims


def test_forward_flops_counts_projections_and_attention():
    """BERT: 4 d² + 2 d f multiply-adds per token per layer, and 2 n d for scores + values over a document of n."""
    n = 10
    bert = ModelDims(hidden=8, intermediate=32, heads=2, layers=2)
    assert bert.forward_flops([n]) / n == 2 * 2 * (4 * 8 * 8 + 2 * 8 * 32) + 4 * 2 * 8 * n
    gated = ModelDims(hidden=8, intermediate=32, heads=2, layers=2, kv_heads=1, head_dim=4, gated=True)
    assert gated.forward_flops([n]) / n == 2 * 2 * (8 * 4 * 4 + 2 * 4 * 8 + 3 * 8 * 32) + 4 * 2 * 2 * 4 * n


def test_attention_is_within_each_document():
    dims = ModelDims(hidden=8, intermediate=32, heads=2, layers=1)
    packed, one = dims.forward_flops([3, 5]), dims.forward_flops([8])
    assert one - packed == 2 * 2 * 8 * (8 * 8 - 3 * 3 - 5 * 5)  # the cross-document scores a packed row skips
    assert dims.forward_flops([4] * 3) == 3 * dims.forward_flops([4])  # a padded bucket: one row per document
