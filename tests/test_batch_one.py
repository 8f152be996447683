"""Batch size 1 gives the right gradients (torch's CPU batch-norm backward is wrong for some gradient strides
at N == 1: timm_lambda/layers/batch_one.py).

Layers: ``gradcheck`` at batch 1 in float64, train and eval mode. Models: a batch of one sample against the
same sample duplicated into a batch of two with the loss on the first copy. The batch statistics of [h, h]
equal those of h, so both are the same function of the parameters: the parameter gradients must be equal,
and the input gradient of the single sample must equal the sum over the two copies (in eval mode the second
copy's is zero).
"""
import pytest
import torch
from torch import nn

from _batch_one import check_model_batch_one, model_params, randomize_norms
from timm_lambda.layers import (
    AugmentedConv2d,
    AxialSelfAttention2d,
    LambdaLayer,
    LocalSelfAttention2d,
    MultiHeadLambdaLayer,
    RelPosSelfAttention2d,
)

LAYERS = [
    ('lambda_local', lambda **kw: LambdaLayer(8, dim_k=4, heads=2, scope=3, **kw)),
    ('lambda_local_u2', lambda **kw: LambdaLayer(8, dim_k=4, heads=2, dim_u=2, scope=3, **kw)),
    ('lambda_dilated', lambda **kw: LambdaLayer(8, dim_k=4, heads=2, scope=3, dilation=2, **kw)),
    ('lambda_global', lambda **kw: LambdaLayer(8, dim_k=4, heads=2, scope='global', max_size=(5, 6), **kw)),
    ('multihead_local', lambda **kw: MultiHeadLambdaLayer(8, dim_k=2, heads=2, scope=3, **kw)),
    ('relpos', lambda **kw: RelPosSelfAttention2d(8, num_heads=2, feat_size=(5, 6), **kw)),
    ('axial', lambda **kw: AxialSelfAttention2d(8, num_heads=2, feat_size=(5, 6), **kw)),
    ('local', lambda **kw: LocalSelfAttention2d(8, num_heads=2, kernel_size=3, **kw)),
    ('augmented', lambda **kw: AugmentedConv2d(8, 16, heads=2, max_size=(5, 6), min_dim_head_k=2, upsilon=0.25,
                                               **kw)),
]
FORMS = ['einsum', 'conv', 'dense', 'tiled']


def _gradcheck_batch_one(layer: nn.Module, train: bool):
    layer = randomize_norms(layer.double()).train(train)
    x = torch.randn(1, 8, 5, 6, dtype=torch.float64, requires_grad=True)
    params = tuple(p for p in layer.parameters())
    # the input and every parameter, through one functional call
    names = [n for n, _ in layer.named_parameters()]

    def f(x, *ps):
        return torch.func.functional_call(layer, dict(zip(names, ps)), (x,))

    assert torch.autograd.gradcheck(f, (x,) + tuple(p.detach().requires_grad_() for p in params))


@pytest.mark.parametrize('train', [True, False], ids=['train', 'eval'])
@pytest.mark.parametrize('stride', [1, 2])
@pytest.mark.parametrize('form', FORMS)
def test_lambda_layer_gradcheck_batch_one(form, stride, train):
    torch.manual_seed(0)
    _gradcheck_batch_one(LambdaLayer(8, dim_k=4, heads=2, scope=3, form=form, stride=stride), train)


@pytest.mark.parametrize('train', [True, False], ids=['train', 'eval'])
@pytest.mark.parametrize('name,make', LAYERS, ids=[c[0] for c in LAYERS])
def test_layer_gradcheck_batch_one(name, make, train):
    torch.manual_seed(0)
    _gradcheck_batch_one(make(), train)


@pytest.mark.parametrize('name,train', model_params(skip_deepest=True))
def test_model_batch_one_equals_duplicated_batch(name, train):
    check_model_batch_one(name, train)


def _torch_batch_norm_gradcheck(batch: int, training: bool) -> bool:
    """Torch alone: ``F.batch_norm`` -> ``reshape(B, C, n)`` -> ``transpose(1, 2)`` -> ``matmul`` (the lambda layer's
    pattern), gradcheck of the input gradient; at B == 1 the gradient reaching batch norm has strides
    ``(C, 1, W*C, C)`` and torch's CPU kernel mishandles it."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    C, H, W = 8, 5, 4
    x = torch.randn(batch, C, H, W, dtype=torch.float64, generator=g, requires_grad=True)
    weight, bias = torch.randn(C, dtype=torch.float64, generator=g), torch.randn(C, dtype=torch.float64, generator=g)
    mean, var = torch.randn(C, dtype=torch.float64, generator=g), torch.rand(C, dtype=torch.float64, generator=g) + 0.5
    other = torch.randn(batch, 3, H * W, dtype=torch.float64, generator=g)

    def f(x):
        y = F.batch_norm(x, None if training else mean, None if training else var, weight, bias, training=training)
        return torch.matmul(other, y.reshape(batch, C, H * W).transpose(1, 2))

    return torch.autograd.gradcheck(f, (x,), raise_exception=False)


@pytest.mark.parametrize('train', [True, False], ids=['train', 'eval'])
def test_torch_batch_norm_backward_is_still_wrong_at_batch_one(train):
    """The upstream bug that timm_lambda/layers/batch_one.py works around, in torch alone (the torch versions it was
    seen on: docs/execution_modes.md): wrong at batch 1, right at batch 2. When this fails at batch 1, torch has fixed
    it: the workaround can go for the versions that have the fix."""
    assert _torch_batch_norm_gradcheck(2, train)
    assert not _torch_batch_norm_gradcheck(1, train), f'torch {torch.__version__} has fixed the batch-1 bug'
