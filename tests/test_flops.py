"""Multiply-add counts (the README model table's GMACs column, ``_lib.docs.forward_macs``): torch's FlopCounterMode
counts the lambda operator (``timm_lambda::lambda_layer``) by its registered FLOP formula, on the meta device as on a
CPU."""

import pytest
import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

from _layer_helpers import CUSTOM_OP_FLOPS
from _lib.docs import forward_macs
from timm_lambda.layers import LambdaLayer

pytestmark = CUSTOM_OP_FLOPS


def _counts(module, x):
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        module(x)
    return {str(op): flops // 2 for op, flops in counter.get_flop_counts()['Global'].items()}


def test_meta_device_counts_as_a_cpu_does():
    # resnet26_lambda_cifar at 32 px runs both forms ('auto': tiled at 32 and 16 px, dense at 8 and 4 px)
    meta_model = timm.create_model('resnet26_lambda_cifar', device='meta')
    size = meta_model.pretrained_cfg['input_size']
    on_meta = forward_macs(meta_model, size)
    counts = _counts(timm.create_model('resnet26_lambda_cifar').eval(), torch.randn(1, *size))
    assert counts['timm_lambda.lambda_layer'] > 0
    assert on_meta == sum(counts.values())


def test_dense_operator_counts_as_torch_counts_its_plain_ops(backend):
    """The lambda operator's formula in the dense form against torch's own count of the same arithmetic in plain
    tensor ops (the form that traces and exports run): equal in all. Without the formula the operator would count
    0."""
    model = timm.create_model('resnet26_lambda_cifar', device='meta').eval()
    for layer in model.modules():
        if isinstance(layer, LambdaLayer):
            layer.form = 'dense'
    x = torch.zeros(1, 3, 32, 32, device='meta')
    ops = _counts(model, x)
    backend('plain')
    plain = _counts(model, x)
    assert 'timm_lambda.lambda_layer' not in plain
    lambdas = ops.pop('timm_lambda.lambda_layer')
    assert lambdas > 0.4 * sum(ops.values())  # the lambda computation is a large share: a missing formula shows
    assert sum(ops.values()) + lambdas == sum(plain.values())


@pytest.mark.parametrize('form', ['dense', 'tiled'])
def test_position_lambda_count_by_hand(form):
    """One layer, 16x16 input, |k| = 16, 4 heads, |v| = 64 / 4 = 16, 7x7 scope. dense: every (query, context)
    pair: logits |n| |h| |n| |k| and output |n| |h| |n| |v|. tiled: 2x2 blocks of 8x8 queries, each
    query against its own 7x7 scope (the CPU kernel's exact arithmetic): logits |k| per offset, output |v| per offset
    inside the image (along each axis 16 x 7 offsets minus 3 + 2 + 1 at each border = 100), and the content term
    that the operator applies inside, |k| |v| per query and head; both forms also the content lambda, |k| |n| |v|."""
    layer = LambdaLayer(64, dim_k=16, heads=4, scope=7, form=form, device='meta').eval()
    counts = _counts(layer, torch.zeros(1, 64, 16, 16, device='meta'))
    n, h, k, v = 16 * 16, 4, 16, 16
    if form == 'dense':
        expected = n * h * n * (k + v) + n * h * k * v
    else:
        expected = n * h * 7 * 7 * k + h * 100 * 100 * v + n * h * k * v
    assert counts['timm_lambda.lambda_layer'] == expected + k * n * v


def test_paper_counts_a_multiply_add_as_two_flops():
    # AA paper Table 3: ResNet-50 8.2 GFlops at 224 px (timm's resnet50 is He et al.'s); paper.FLOPS is read so
    macs = forward_macs(timm.create_model('resnet50', device='meta'), (3, 224, 224))
    assert round(2 * macs / 1e9, 1) == 8.2
