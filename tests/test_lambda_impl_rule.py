"""impl='auto' cost rule (docs/lambda_layer_benchmark.md): einsum while |n| <= 2 * kernel area and
the gathered embeddings fit EINSUM_MAX_EMBEDDING_BYTES, the lambda convolution otherwise."""
import torch

from timm_lambda.layers import EINSUM_MAX_KERNEL_RATIO, LambdaLayer


def test_small_scope_switches_to_conv_early():
    # |u|=4, scope 7x7 (F.2's setting for |u| > 1): measured crossover between 8x8 and 12x12
    layer = LambdaLayer(16, dim_k=4, heads=2, dim_u=4, scope=7)
    assert EINSUM_MAX_KERNEL_RATIO * 7 * 7 >= 9 * 9
    assert layer.choose_impl(9, 9) == 'einsum'
    assert layer.choose_impl(12, 12) == 'conv'


def test_default_scope_uses_einsum_until_the_memory_cap():
    layer = LambdaLayer(16, dim_k=16, heads=4)  # scope 23: kernel 23x23 binds at 27x27 via the 32 MiB cap
    assert layer.choose_impl(26, 26) == 'einsum'
    assert layer.choose_impl(27, 27) == 'conv'
    # a small input crops the kernel to the offsets that occur: 2x2 -> 3x3 kernel, |n| = 4 <= 18
    assert layer.choose_impl(2, 2) == 'einsum'


def test_auto_gives_the_same_output_as_either_impl():
    torch.manual_seed(0)
    layer = LambdaLayer(16, dim_k=4, heads=2, dim_u=4, scope=7).eval()
    x = torch.randn(2, 16, 12, 12)
    auto = layer(x)
    layer.impl = 'einsum'
    torch.testing.assert_close(auto, layer(x), rtol=1e-5, atol=1e-5)
