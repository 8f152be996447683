"""Shared test setup for lambda layers compared against the float64 references in eval mode."""
import pytest
import torch
from torch import nn

from timm_lambda._compat import parse_version
from timm_lambda.layers import RelativePositionEmbedding


def perturb_for_eval(layer: nn.Module, g: torch.Generator, emb_scale: float = 0.3) -> nn.Module:
    """Non-trivial BatchNorm statistics and affine parameters (drawn from ``g``, module by module) and a table
    shrunk by ``emb_scale``, so eval-mode outputs exercise every term and stay O(1) (a float32 comparison at
    ``rtol=atol=1e-5`` then means something); in place, under no_grad."""
    with torch.no_grad():
        for m in layer.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.rand(m.num_features, generator=g) - 0.5)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) * 0.5 + 0.5)
                m.bias.copy_(torch.rand(m.num_features, generator=g) * 0.4 - 0.2)
            if isinstance(m, RelativePositionEmbedding):
                m.weight.mul_(emb_scale)
    return layer


# torch 2.4's FlopCounterMode does not call the formulas registered for custom operators (it counts them as 0):
# counting the position lambdas needs torch >= 2.5 (docs/install.md)
CUSTOM_OP_FLOPS = pytest.mark.skipif(parse_version(torch.__version__) < (2, 5),
                                     reason="FlopCounterMode ignores custom operators' FLOP formulas before torch 2.5")
