"""The 3x3 stride-2 average pooling after a stride-2 layer (appendix F.2), on a contiguous input.

torch's CUDA backward of ``avg_pool2d`` returns wrong input gradients for a channels-last input when the padding is
not zero (pytorch/pytorch#188344, fixed in torch by pytorch/pytorch#188345 in July 2026; seen here with torch
2.11.0+cu130 on an H200: relative errors of 1 to 10^4 in ``tests/test_cuda.py``). A permuted view (the position
lambdas' output) or a channels-last model hands the pool such an input, and a batch-1 map can look channels-last
by its strides alone. A contiguous input takes the NCHW kernels, which are right: one copy where the input is not
contiguous, on every device (no branch on the device, which the FX tracers could not record).
"""
import torch.nn.functional as F
from torch import Tensor, nn

from .execution import compiled_fresh_copy, contiguous

__all__ = ['avg_pool_3x3_s2', 'DownsamplePool', 'downsample_pool']


def avg_pool_3x3_s2(x: Tensor, count_include_pad: bool = False) -> Tensor:
    """``[B, C, H, W] -> [B, C, ceil(H/2), ceil(W/2)]``: 3x3 average pooling, stride 2, padding 1 (``count_include_pad``
    as ``nn.AvgPool2d``), computed on a contiguous copy of ``x`` (see above)."""
    return F.avg_pool2d(contiguous(x), 3, 2, 1, count_include_pad=count_include_pad)


class DownsamplePool(nn.AvgPool2d):
    """``nn.AvgPool2d(3, 2, 1)`` by :func:`avg_pool_3x3_s2` (same repr and state: no parameters or buffers).
    ``fresh_input``: under torch.compile the pool runs on :func:`~.execution.compiled_fresh_copy` of its input, for
    a layer whose output before the pool is a view (the pool saves its input for backward)."""

    def __init__(self, count_include_pad: bool = False, fresh_input: bool = False):
        super().__init__(3, 2, padding=1, count_include_pad=count_include_pad)
        self.fresh_input = fresh_input

    def forward(self, x: Tensor) -> Tensor:
        if self.fresh_input:
            x = compiled_fresh_copy(x)
        return avg_pool_3x3_s2(x, self.count_include_pad)


def downsample_pool(stride: int, count_include_pad: bool = False, fresh_input: bool = False) -> nn.Module:
    """The downsampling after a stride-2 layer (appendix F.2; see ``LambdaLayer``'s ``stride``), else an identity;
    ``fresh_input``: see :class:`DownsamplePool`."""
    return DownsamplePool(count_include_pad, fresh_input) if stride == 2 else nn.Identity()
