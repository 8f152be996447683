"""Shared test setup for lambda layers compared against the float64 references in eval mode."""
import torch
from torch import nn

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
