"""The lambda layer's projection: queries, keys and values from the input by one 1x1 convolution (``W_Q``, ``W_K``,
``W_V`` of Table 1), ``[B, d, H, W] -> [B, out, H, W]``.

On a CPU where oneDNN runs bfloat16 on AMX tiles, a bfloat16 call (autocast's, or bfloat16 inputs) computes the same
product as a batched matmul, ``W [out, d] @ x [B, d, H W]``: oneDNN's 1x1 convolution reorders its NCHW input, output
and gradients to and from its blocked layouts around the AMX products, which then cost more than the products (2-3x
the matmul's step at the LambdaResNet shapes: ``benchmarks/benchmark_projection.py``, docs/results/projection.json).
Elsewhere (float32, CUDA, a CPU without AMX: there the two are equal or the convolution is faster) and in
TorchScript, the convolution. The module stays an ``nn.Conv2d``: its weights, state dict, hooks and the layer's
``reparameterize`` are the convolution's.
"""
import functools
import os

import torch
from torch import nn

from .position_lambda.plan import call_dtype

__all__ = ['Projection', 'as_matmul', 'amx_bf16']


@functools.lru_cache(maxsize=None)
def amx_bf16() -> bool:
    """Whether oneDNN runs bfloat16 products on AMX tiles here: the CPU has them (``torch.cpu``'s cpuinfo check) and
    ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``) does not cap oneDNN below them. Read once a process."""
    cap = (os.environ.get('ONEDNN_MAX_CPU_ISA') or os.environ.get('DNNL_MAX_CPU_ISA') or 'ALL').upper()
    has_amx = getattr(torch.cpu, '_is_amx_tile_supported', None)  # (torch's cpuinfo check; absent: no matmul)
    return bool(has_amx is not None and has_amx()) and (cap == 'ALL' or 'AMX' in cap)


def as_matmul(x: torch.Tensor) -> bool:
    """Whether the projection of ``x`` runs as a matmul (see the module's docstring): a contiguous 4-D CPU map whose
    call computes in bfloat16, on a CPU with AMX (torch.fx's symbolic tracing, whose proxies have no device or
    dtype to test: the convolution)."""
    # (cheapest first: on a CPU without AMX one cached call; a proxy before any test of its device)
    return (amx_bf16() and not isinstance(x, torch.fx.Proxy) and x.is_cpu
            and call_dtype(x)[0] == torch.bfloat16 and x.dim() == 4 and x.is_contiguous())


class Projection(nn.Conv2d):
    """A 1x1 convolution ``d -> out`` (no padding, stride 1, one group), computed as a matmul where
    :func:`as_matmul` says so."""

    def __init__(self, in_channels: int, out_channels: int, bias: bool = False, device=None, dtype=None):
        super().__init__(in_channels, out_channels, 1, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # (TorchScript: the convolution; a scripted model loads without this package)
            return self._conv_forward(x, self.weight, self.bias)
        return self._matmul(x) if as_matmul(x) else self._conv_forward(x, self.weight, self.bias)

    @torch.jit.unused
    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        b, d, h, w = x.shape
        # (bmm of the weight expanded over the batch: matmul's [out, d] @ [B, d, n] computes x^T W^T and copies the
        # transposed result back; autocast casts both to bfloat16)
        y = torch.bmm(self.weight.view(1, self.out_channels, d).expand(b, self.out_channels, d), x.view(b, d, h * w))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype).unsqueeze(-1)
        return y.view(b, self.out_channels, h, w)
