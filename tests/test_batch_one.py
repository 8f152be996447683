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
