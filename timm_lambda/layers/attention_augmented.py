"""Attention augmented convolution (Bello, Zoph, Vaswani, Shlens, Le: "Attention Augmented Convolutional
Networks", ICCV 2019, section 3.2 and appendix A.3)::

    AAConv(X) = Concat[Conv(X), MHA(X)]

``Conv`` has ``F_out - d_v`` output filters, ``MHA`` is multi-head self-attention over the whole feature map
with 2-D relative position logits (:class:`~timm_lambda.layers.RelPosSelfAttention2d`, eq. 3-4) followed by
a 1x1 convolution ``W^O`` mixing the heads (eq. 2). ``kappa = d_k / F_out`` and ``upsilon = d_v / F_out``.

Choices where the paper leaves room (tested against its parameter counts, README "Attention baselines"):

* **Depth per head.** ``d_v^h = floor(upsilon F_out / N_h)`` and
  ``d_k^h = max(min_dim_head_k, floor(kappa F_out / N_h))`` with ``min_dim_head_k = 20``: the paper states
  "a minimum of 20 dimensions per head for the keys" for its CIFAR-100 networks only, but the same rule is
  the only one we found that reproduces its ImageNet counts: AA-ResNet-34/50/101/152 20.7/25.8/45.4/61.6M
  (Table 3) and kappa = upsilon = 0.25/0.5/0.75/1.0 24.3/22.3/20.7/19.4M (Table 6), each within 0.5%. Without
  the minimum (``min_dim_head_k=1``) AA-ResNet-50 has 25.1M and the Table 6 rows are up to 2.2% low.
* **Stride.** The paper's code has none. A strided layer convolves with stride 2 and runs the attention on
  the input average-pooled 3x3 with stride 2 (the paper's downsampling operation), i.e. at the output
  resolution: Table 9 lists every c4 attention at 14x14 and every c5 one at 7x7 in a 224 px ResNet-50.
* **Downsampled attention** (``attn_downsample=True``): "downsample [the attention inputs] only during the
  first stage [where attention is applied]" (section 4.2) with 3x3 average pooling, stride 2, and bilinear
  upsampling (section 3.2); Table 9 lists the c3 attention at 14x14. PyTorch's bilinear
  ``align_corners=False`` (TF1's ``resize_bilinear`` samples slightly differently).
* **Biases.** The paper's TF code keeps ``tf.layers.conv2d``'s default biases; here no convolution has one
  (each output goes through the batch norm that follows the layer): 0.01M fewer in AA-ResNet-50.
* **Relative tables** cover inputs of up to ``max_size`` (the paper sizes them to the one input size);
  larger inputs raise a ValueError naming ``img_size``. Initialised N(0, d_k^h ** -0.5) as the paper's code
  intends (its ``tf.random_normal_initializer(dkh**-0.5)`` passes that value as the *mean*).
"""
import math
import warnings
from typing import Optional, Tuple

import torch
from torch import nn

from .checks import check_ratio, check_stride, to_int, to_pair
from .dilation import check_dilation
from .pooling import downsample_pool
from .relative_attention import RelPosSelfAttention2d, upsample_to

__all__ = ['AugmentedConv2d', 'augmented_depths']


def augmented_depths(dim_out: int, kappa: float, upsilon: float, heads: int,
                     min_dim_head_k: int = 20) -> Tuple[int, int]:
    """``(d_k^h, d_v^h)``, key and value depth per head, of an augmented convolution with ``dim_out`` filters."""
    dim_head_v = math.floor(upsilon * dim_out / heads + 1e-9)
    dim_head_k = max(min_dim_head_k, math.floor(kappa * dim_out / heads + 1e-9))
    return dim_head_k, dim_head_v


_UNSET = object()


def _renamed(value, default, old_value, name: str, old_name: str):
    """``(value, the name to cite in errors)`` of an argument renamed ``old_name`` -> ``name``; the old name is
    still accepted, with a DeprecationWarning."""
    if old_value is _UNSET:
        return value, name
    if not (value is default or value == default):
        raise TypeError(f'AugmentedConv2d got {name} and its deprecated name {old_name}: pass {name} only')
    warnings.warn(f'AugmentedConv2d({old_name}=...) is deprecated, use {name}=... (the name LambdaLayer uses)',
                  DeprecationWarning, stacklevel=3)
    return old_value, old_name


class AugmentedConv2d(nn.Module):
    """Attention augmented ``kernel_size x kernel_size`` convolution, a drop-in for ``nn.Conv2d`` (NCHW).

    Argument names follow our :class:`~timm_lambda.layers.LambdaLayer` (``heads``, ``max_size``); ``num_heads``
    and ``feat_size``, the names of earlier versions, still work with a DeprecationWarning.

    timm (1.0.31) has no attention augmented convolution. Its attention part is timm's
    :class:`timm.layers.BottleneckAttn` (global multi-head self-attention with 2-D relative logits, which
    :class:`~timm_lambda.layers.RelPosSelfAttention2d` extends), whose arguments map as follows: ``heads`` is
    its ``num_heads``; ``max_size`` its ``feat_size`` (timm: exactly that input size; here any input up to it);
    the key depth per head ``d_k^h`` (from ``kappa``, ``min_dim_head_k``) its ``dim_head``; the attention width
    ``d_v = upsilon * dim_out`` its ``dim_out`` (so ``kappa / upsilon`` plays its ``qk_ratio``); it has no
    convolution branch, no ``W^O`` projection and no ``attn_downsample``, and its ``qkv_bias`` is False here.
    timm's ``LambdaLayer`` says ``num_heads``/``dim_head``/``r``/``feat_size`` where ours says
    ``heads``/``dim_k``/``scope``/``max_size``.

    Args:
        dim: input filters ``F_in``.
        dim_out: output filters ``F_out`` (default ``dim``): ``F_out - d_v`` from the convolution, then ``d_v``
            from the attention.
        kernel_size: odd kernel size of the convolution (default 3).
        stride: 1 or 2 (see the module docstring).
        kappa: key depth ratio ``d_k / F_out`` (> 0; default 0.2).
        upsilon: value depth ratio ``d_v / F_out`` in (0, 1] (default 0.1); 1 leaves no convolution.
        heads: heads ``N_h`` (default 8).
        min_dim_head_k: lower bound of the key depth per head (default 20, see the module docstring).
        max_size: (H, W) of the largest attention input, i.e. the layer's output size divided by 2 when
            ``attn_downsample`` (sizes the relative tables).
        attn_downsample: average-pool the attention input 3x3 with stride 2 and upsample its output bilinearly.
        dilation: dilation of the convolution (in a dilated backbone stage, output_stride 16 / 8; needs
            stride 1); the attention is global and has none.
        norm_layer: accepted for the mixer interface (the batch norm after the layer normalises both parts).
        device, dtype: factory kwargs.

    Shapes: ``[B, dim, H, W] -> [B, dim_out, ceil(H / stride), ceil(W / stride)]``.
    """

    def __init__(
            self,
            dim: int,
            dim_out: Optional[int] = None,
            kernel_size: int = 3,
            stride: int = 1,
            kappa: float = 0.2,
            upsilon: float = 0.1,
            heads: int = 8,
            min_dim_head_k: int = 20,
            max_size: Optional[Tuple[int, int]] = None,
            attn_downsample: bool = False,
            dilation: int = 1,
            norm_layer=None,
            device=None,
            dtype=None,
            *,
            num_heads=_UNSET,
            feat_size=_UNSET,
    ):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.dim = to_int(dim, 'dim')
        self.dim_out = to_int(self.dim if dim_out is None else dim_out, 'dim_out')
        kernel_size = to_int(kernel_size, 'kernel_size')
        if kernel_size % 2 == 0:
            raise ValueError(f'kernel_size must be odd, got {kernel_size}')
        self.stride = check_stride(stride)
        self.kappa = check_ratio(kappa, 'kappa')
        self.upsilon = check_ratio(upsilon, 'upsilon', high=1.0)
        heads, heads_name = _renamed(heads, 8, num_heads, 'heads', 'num_heads')
        max_size, size_name = _renamed(max_size, None, feat_size, 'max_size', 'feat_size')
        self.heads = to_int(heads, heads_name)
        min_dim_head_k = to_int(min_dim_head_k, 'min_dim_head_k')
        if not isinstance(attn_downsample, bool):
            raise ValueError(f'attn_downsample must be True or False, got {attn_downsample!r}')
        if max_size is None:
            raise ValueError(f'{size_name}=(H, W) of the largest attention input is required: it sizes the '
                             'relative position tables')
        max_size = to_pair(max_size, size_name)
        self.dim_head_k, self.dim_head_v = augmented_depths(self.dim_out, self.kappa, self.upsilon, self.heads,
                                                            min_dim_head_k)
        if self.dim_head_v < 1:
            raise ValueError(f'upsilon={self.upsilon} gives d_v = upsilon * dim_out = {self.upsilon * self.dim_out:g} '
                             f'attention channels for dim_out={self.dim_out}, fewer than {heads_name}={self.heads}: '
                             f'raise upsilon or lower {heads_name}')
        self.dim_v = self.heads * self.dim_head_v
        self.dim_k = self.heads * self.dim_head_k
        conv_out = self.dim_out - self.dim_v
        self.dilation = check_dilation(dilation)
        if self.dilation > 1 and self.stride != 1:
            raise ValueError(f'dilation={dilation} needs stride=1, got stride={self.stride}')
        self.conv = nn.Conv2d(self.dim, conv_out, kernel_size, self.stride, padding=self.dilation * (kernel_size // 2),
                              dilation=self.dilation, bias=False, **dd) if conv_out > 0 else None
        self.pool = downsample_pool(self.stride)
        self.attn_downsample = attn_downsample
        # not "attn_pool": torchvision's FX feature extraction confuses it with "attn.pool" (regex dot)
        self.attn_down = downsample_pool(2 if attn_downsample else 1)
        self.attn = RelPosSelfAttention2d(self.dim, self.dim_v, feat_size=max_size, num_heads=self.heads,
                                          dim_head=self.dim_head_k, **dd)
        self.proj = nn.Conv2d(self.dim_v, self.dim_v, 1, bias=False, **dd)

    @property
    def num_heads(self) -> int:
        """``heads`` under timm's name (``BottleneckAttn.num_heads``)."""
        return self.heads

    def reset_parameters(self) -> None:
        """The attention's q/k/v projection and relative tables (timm's BottleneckAttn initialisation; the
        convolutions keep the model's initialisation)."""
        self.attn.reset_parameters()

    def extra_repr(self) -> str:
        return (f'dim={self.dim}, dim_out={self.dim_out}, stride={self.stride}, kappa={self.kappa}, '
                f'upsilon={self.upsilon}, d_k={self.dim_k}, d_v={self.dim_v}, heads={self.heads}, '
                f'attn_downsample={self.attn_downsample}')

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.pool(x)  # the attention input at the output resolution
        out = self.proj(self.attn(self.attn_down(a)))
        if self.attn_downsample:
            out = upsample_to(out, a)
        if self.conv is not None:
            out = torch.cat([self.conv(x), out], dim=1)
        return out
