"""impl='auto' rule (timm_lambda.layers.position_lambda.choose_impl): the dense form while its |n|^2 (query, context)
pairs are at most a quarter of the tiled form's (queries padded to whole 8x8 blocks) x (block window) pairs, the
tiled form above; global scopes always dense. The expected choices below are the faster form measured by
`tools/benchmark_lambda_layer.py --sweep` on 2 CPU cores (docs/results/sweep_*.json)."""
import pytest
import torch

from timm_lambda.layers import LambdaLayer
from timm_lambda.layers.position_lambda import TILE, tile_window


@pytest.mark.parametrize('side,faster', [(8, 'dense'), (12, 'dense'), (14, 'dense'), (15, 'dense'), (16, 'tiled'),
                                         (17, 'dense'), (20, 'tiled'), (22, 'tiled'), (32, 'tiled'), (64, 'tiled')])
def test_default_scope_follows_the_sweep(side, faster):
    layer = LambdaLayer(16, dim_k=16, heads=4)  # scope 23: 8x8 blocks, 30x30 context windows
    assert TILE == 8 and tile_window(23, 23) == 900
    assert layer.choose_impl(side, side) == faster


@pytest.mark.parametrize('side,faster', [(5, 'dense'), (7, 'dense'), (8, 'tiled'), (9, 'dense'), (10, 'dense'),
                                         (12, 'tiled'), (16, 'tiled')])
def test_small_scope_follows_the_sweep(side, faster):
    # |u|=4, scope 7x7 (F.2's setting for |u| > 1): 8x8 blocks, 14x14 windows
    layer = LambdaLayer(16, dim_k=4, heads=2, dim_u=4, scope=7)
    assert layer.choose_impl(side, side) == faster


def test_one_pixel_is_dense():
    assert LambdaLayer(16, dim_k=16, heads=4).choose_impl(1, 1) == 'dense'


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
