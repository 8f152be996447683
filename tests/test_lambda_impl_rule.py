"""impl='auto' rule (timm_lambda.layers.position_lambda.choose_impl): the dense attention form while the input
has at most half as many positions as one query block's context window of the tiled form, the tiled form above
(measured crossovers: tools/benchmark_lambda_layer.py --sweep); global scopes always dense."""
import torch

from timm_lambda.layers import LambdaLayer
from timm_lambda.layers.position_lambda import TILE, tile_window


def test_default_scope_switches_at_one_window():
    layer = LambdaLayer(16, dim_k=16, heads=4)  # scope 23: 8x8 blocks, 30x30 context windows
    assert TILE == 8 and tile_window(23, 23) == 900
    assert layer.choose_impl(21, 21) == 'dense'  # 441 <= 450
    assert layer.choose_impl(22, 21) == 'tiled'
    assert layer.choose_impl(1, 1) == 'dense'


def test_small_scope_switches_early():
    # |u|=4, scope 7x7 (F.2's setting for |u| > 1): 8x8 blocks, 14x14 windows
    layer = LambdaLayer(16, dim_k=4, heads=2, dim_u=4, scope=7)
    assert layer.choose_impl(9, 10) == 'dense'
    assert layer.choose_impl(10, 10) == 'tiled'


def test_global_scope_is_always_dense():
    layer = LambdaLayer(16, dim_k=4, heads=2, scope='global', max_size=(64, 64))
    assert layer.choose_impl(64, 64) == 'dense'


def test_explicit_impl_is_kept():
    layer = LambdaLayer(16, dim_k=4, heads=2, impl='conv')
    assert layer.choose_impl(1, 1) == 'conv'


def test_auto_gives_the_same_output_as_every_impl():
    torch.manual_seed(0)
    layer = LambdaLayer(16, dim_k=4, heads=2, dim_u=4, scope=7).eval()
    for hw in [(9, 9), (12, 11)]:
        x = torch.randn(2, 16, *hw)
        layer.impl = 'auto'
        auto = layer(x)
        for impl in ('einsum', 'conv', 'dense', 'tiled'):
            layer.impl = impl
            torch.testing.assert_close(auto, layer(x), rtol=1e-4, atol=1e-4)
