"""The batch-1 gradient check of tests/test_batch_one.py, shared with its GPU run (tests/test_cuda.py): a batch of one
sample against the same sample duplicated into a batch of two with the loss on the first copy (the batch statistics
of [h, h] equal those of h, so the parameter gradients must be equal, and the input gradient of the single sample must
equal the sum over the two copies), and the randomised batch norms it needs."""
from typing import Optional

import pytest
import timm
import torch
from torch import nn

import timm_lambda
from _timm_suite_filters import excluded_models


def randomize_norms(model: nn.Module, seed: int = 0, calibrate: Optional[torch.Tensor] = None) -> nn.Module:
    """Non-trivial affine parameters in every batch norm (this also undoes timm's ``zero_init_last``, so every
    branch carries gradient) and running statistics of real activations: those of the batch ``calibrate``
    when given.
    Random statistics, or those of other samples, blow the eval-mode activations of a deep lambda network up:
    a lambda layer's output is quadratic in its normalised queries and values, so a mismatch squares block
    after block."""
    g = torch.Generator().manual_seed(seed)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    with torch.no_grad():
        for m in norms:
            c = m.num_features
            m.weight.copy_(torch.rand(c, generator=g, dtype=torch.float64) * 0.5 + 0.5)
            m.bias.copy_(torch.rand(c, generator=g, dtype=torch.float64) * 0.4 - 0.2)
            m.running_mean.copy_(torch.rand(c, generator=g, dtype=torch.float64) - 0.5)
            m.running_var.copy_(torch.rand(c, generator=g, dtype=torch.float64) + 0.5)
        # the last norm of every residual branch (what timm's zero_init_last zeroes) in [0.1, 0.2]: residual
        # streams that stay near their scale, in eval mode too
        for m in model.modules():
            if hasattr(m, 'zero_init_last') and m is not model:
                m.zero_init_last()
        for m in norms:
            if not m.weight.any():
                m.weight.copy_(torch.rand(m.num_features, generator=g, dtype=torch.float64) * 0.1 + 0.1)
        if calibrate is not None:
            momenta = [m.momentum for m in norms]
            counts = {}
            hooks = [m.register_forward_pre_hook(lambda m, i: counts.__setitem__(m, i[0].numel() // m.num_features))
                     for m in norms]
            for m in norms:
                m.reset_running_stats()
                m.momentum = None  # a cumulative average: one batch sets the statistics
            model.train()(calibrate)
            for m, momentum, hook in zip(norms, momenta, hooks):
                hook.remove()
                m.momentum = momentum
                n = counts[m]
                m.running_var.mul_((n - 1) / n)  # the biased variance that normalised the batch
    return model


def input_size(name: str) -> int:
    return min(64, timm.models.get_pretrained_cfg(name).input_size[-1])


def _grads(model: nn.Module, x: torch.Tensor, weight: torch.Tensor, forward=None):
    """Gradients of a loss on the first sample's features (a weight per channel and position: a loss after
    global pooling leaves the last train-mode norm of some networks, timm's mobilenetv2 among them, almost no
    gradient, and the comparison would measure rounding)."""
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    ((forward or model.forward_features)(x)[0] * weight).sum().backward()
    return x.grad, [p.grad for p in model.parameters()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def worst_grad_diff(gs1, gs2) -> float:
    """Largest relative difference over parameter gradients, each relative to its own norm or to a millionth
    of the largest gradient norm, whichever is larger (a gradient that is zero in exact arithmetic, such as
    the bias of a norm followed only by train-mode norms, holds rounding alone)."""
    pairs = [(a, b) for a, b in zip(gs1, gs2) if b is not None]
    floor = 1e-6 * max(b.norm() for _, b in pairs)
    return max(((a - b).norm() / torch.maximum(b.norm(), floor)).item() for a, b in pairs)


_DEEP = ('200', '270', '350', '420')
# Train-mode gradients of four networks at initialisation are chaotic in float64: batches of 2 and 4 copies
# of one sample, which no batch-1 problem touches, already differ by a relative 1e-2 (aa_resnet101) to 1
# (the others) in their early layers.
# Eval mode of resnet50_lambda_global32 likewise: c5 is 1x1 at its fixed 32x32 input, its activations reach
# 1e20 with these statistics, and the batch-norm kernels' rounding (another path for a 1x1 map at batch 1)
# already differs in the forward pass. These cases run block by block (_check_blocks).
BLOCK_BY_BLOCK = {('aa_resnet101', True), ('aa_resnet152', True), ('resnet50_axial_attn', True),
                  ('resnet50_global_attn', True), ('resnet50_lambda_global32', False)}


def model_params(skip_deepest: bool = False):
    """(name, train) for every registered model and mode, but for train mode of resnet50_lambda_global32: c5 is
    1x1 at its fixed 32x32 input, and torch refuses train-mode batch norm on one value per channel.
    ``skip_deepest``: without the 350- and 420-deep models, which timm's suite leaves out
    (tests/_timm_suite_filters.py): their blocks are the 270-deep members', and on the CPU they took a third of the
    batch-1 model checks' time (63 of 190 s)."""
    out = []
    names = timm_lambda.registered_models()
    if skip_deepest:
        names = [n for n in names if n not in excluded_models(names)]
    for name in names:
        deep = any(name.startswith(p + d) for p in ('lambdaresnet', 'resnetrs') for d in _DEEP)
        for train in (True, False):
            if train and name == 'resnet50_lambda_global32':
                continue
            marks = [pytest.mark.slow] if deep else []
            out.append(pytest.param(name, train, marks=marks, id=f'{name}-{"train" if train else "eval"}'))
    return out


def _check_duplicate(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, forward=None):
    """Gradients at batch 1 against the sample duplicated into a batch of 2 (loss on the first copy)."""
    state = {k: v.clone() for k, v in module.state_dict().items()}
    gx1, gp1 = _grads(module, x, weight, forward)
    module.load_state_dict(state)  # train mode updated the running statistics
    gx2, gp2 = _grads(module, torch.cat([x, x]), weight, forward)
    assert all(g is not None for g, ref in zip(gp1, gp2) if ref is not None)
    worst = worst_grad_diff(gp1, gp2)
    # the torch bug gives relative errors of 0.1-10; rounding through 100+ float64 layers up to ~1e-6
    assert worst < 1e-5, f'parameter gradients differ by a relative {worst:.3g}'
    assert _rel(gx1[0], gx2.sum(0)) < 1e-5


def _check_blocks(model: nn.Module, size: int, train: bool):
    """Every block of a ResNet-like model on its own, on random activations of its input shape."""
    feats = torch.randn(1, 3, size, size, dtype=torch.float64)
    with torch.no_grad():
        feats = model.eval().maxpool(model.act1(model.bn1(model.conv1(feats))))
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        for block in stage:
            x = torch.randn_like(feats)
            with torch.no_grad():
                out = block.eval()(x)
            _check_duplicate(block.train(train), x, torch.randn(out.shape[1:], dtype=torch.float64), block.forward)
            feats = out


def check_model_batch_one(name: str, train: bool, device: str = 'cpu') -> None:
    """The batch-1 check of one registered model on ``device`` (tests/test_cuda.py runs it on a GPU): the
    norms are randomised and calibrated with CPU generators, then everything runs on the device."""
    torch.manual_seed(0)
    size = input_size(name)
    x = torch.randn(1, 3, size, size, dtype=torch.float64)
    # statistics of the sample and a slightly different one: no channel of a 1x1 map is constant
    calibrate = torch.cat([x, x + 0.3 * torch.randn_like(x)])
    model = randomize_norms(timm.create_model(name, num_classes=5).double(), calibrate=calibrate).to(device)
    x = x.to(device)
    with torch.device(device):  # the helpers make their random tensors on the default device
        if (name, train) in BLOCK_BY_BLOCK:
            _check_blocks(model, size, train)
            return
        with torch.no_grad():
            weight = torch.randn(model.eval().forward_features(x).shape[1:], dtype=torch.float64)
        _check_duplicate(model.train(train), x, weight)
