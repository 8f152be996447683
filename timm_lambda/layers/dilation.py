"""Dilation by space-to-batch: a layer with a local scope applied on a dilated grid (our extension).

LambdaNetworks has no dilated lambda layer. Dilated ("atrous") backbones with output stride 16 or 8 (DeepLab,
Chen et al. 2017; timm's ``output_stride``) keep the resolution of the stages that would downsample and dilate
their 3x3 convolutions so that each still sees the receptive field it was designed for, in steps of the
dilation ``d``. The lambda layers and local self-attention do the same here: the context of query ``n`` is
``m = n + d * o`` for the offsets ``o`` of the scope. As atrous convolution is usually explained, that is the
undilated layer applied to each of the ``d x d`` interleaved sub-grids of the input (space-to-batch), which
lets every existing implementation run unchanged:

* :func:`space_to_batch`: ``[B, C, H, W] -> [B d d, C, ceil(H/d), ceil(W/d)]``, zero-padding H, W up to
  multiples of ``d``; sub-grid ``(i, j)`` holds positions ``(a d + i, b d + j)``.
* :func:`batch_to_space`: the inverse, dropping the padded positions.

Both are FX leaves (their padding depends on the input size).
"""
import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function

from .execution import compiled_fresh_copy, contiguous

__all__ = ['space_to_batch', 'batch_to_space', 'check_dilation']


def check_dilation(dilation) -> int:
    """An int >= 1 (bools refused)."""
    if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1:
        raise ValueError(f'dilation must be an int >= 1, got {dilation!r}')
    return dilation


def space_to_batch(x: torch.Tensor, dilation: int) -> torch.Tensor:
    """``[B, C, H, W] -> [B d^2, C, ceil(H/d), ceil(W/d)]``: the ``d x d`` interleaved sub-grids as batch
    entries (order ``b, i, j``), H and W zero-padded to multiples of ``d``."""
    B, C, H, W = x.shape
    d = dilation
    hs, ws = (H + d - 1) // d, (W + d - 1) // d
    x = F.pad(x, [0, ws * d - W, 0, hs * d - H])
    x = contiguous(x.view(B, C, hs, d, ws, d).permute(0, 3, 5, 1, 2, 4))
    # compiled: a copy, not a view (the lambda operator saves its input for backward, and inductor orders a saved
    # view's strides by sympy comparisons it cannot decide for a square map, whose width after a split of the
    # flattened H W = s**2 reads s**2 // s: an InductorError with dynamic=True, issue 51)
    return compiled_fresh_copy(x.view(B * d * d, C, hs, ws))


def batch_to_space(y: torch.Tensor, dilation: int, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`space_to_batch`: ``[B d^2, C, hs, ws] -> [B, C, height, width]`` (padding dropped)."""
    d = dilation
    Bdd, C, hs, ws = y.shape
    B = Bdd // (d * d)
    y = contiguous(y.view(B, d, d, C, hs, ws).permute(0, 3, 4, 1, 5, 2)).view(B, C, hs * d, ws * d)
    return y.narrow(2, 0, height).narrow(3, 0, width)


# FX leaves for timm's feature extraction; the modules that call them also declare torch.fx.wrap(name)
register_notrace_function(space_to_batch)
register_notrace_function(batch_to_space)
