"""The lambda layer's projection: queries, keys and values from the input by one 1x1 convolution (``W_Q``, ``W_K``,
``W_V`` of Table 1), ``[B, d, H, W] -> [B, out, H, W]``.

On a CPU where oneDNN computes bfloat16 natively (AMX tiles, or AVX-512 BF16 without them), a bfloat16 call
(autocast's, or bfloat16 inputs) computes the same product as a batched matmul, ``W [out, d] @ x [B, d, H W]``:
oneDNN's 1x1 convolution reorders its NCHW input, output and gradients to and from its blocked layouts around the
products, which then cost more than the products (``benchmarks/benchmark_projection.py``, one thread: the matmul's
step 0.33-0.63x the convolution's at the LambdaResNet shapes on an Intel Xeon with AMX, docs/results/projection.json;
0.62-0.76x on an AMD EPYC Zen 5 with AVX-512 BF16, docs/results/projection_amd.json). Where oneDNN has no bfloat16
instructions (an AVX2-only CPU, or oneDNN held below AVX-512 BF16), its bfloat16 convolution is its reference code:
a bfloat16 call there computes the convolution in float32 (docs/results/projection_avx2.json); under autocast it
returns it in float32, unrounded: the norms after it and the position lambdas' kernel, which has no 16-bit products
there either, compute the call in float32 too, and the layer's output is rounded to bfloat16 once (the operator's
autocast rule: ``custom_ops.lambda_op``); a call on bfloat16 tensors (a model in bfloat16) gets it rounded.
Elsewhere (float32, where matmul and convolution are equal; float16; CUDA) and in TorchScript, the convolution. The
module stays an ``nn.Conv2d``: its weights, state dict, hooks and the layer's ``reparameterize`` are the
convolution's.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .position_lambda import plan
from .position_lambda.plan import call_dtype

__all__ = ['Projection', 'project', 'as_matmul', 'in_float32']

def as_matmul(x: torch.Tensor) -> bool:
    """Whether the projection of ``x`` runs as a matmul (see the module's docstring): a contiguous 4-D CPU map whose
    call computes in bfloat16, where oneDNN computes bfloat16 natively (torch.fx's symbolic tracing, whose proxies
    have no device or dtype to test: the convolution)."""
    # (cheapest first: on a CPU without AVX-512 BF16 one cached call; a proxy before any test of its device)
    return (plan.native_bf16() and not isinstance(x, torch.fx.Proxy) and x.is_cpu
            and call_dtype(x)[0] == torch.bfloat16 and x.dim() == 4 and x.is_contiguous())


def in_float32(x: torch.Tensor) -> bool:
    """Whether the projection of ``x`` computes in float32 (returning float32 under autocast) though its call
    computes in bfloat16: a CPU map where oneDNN has no bfloat16 instructions (:func:`.plan.native_bf16` false; see
    the module's docstring)."""
    return (not plan.native_bf16() and not isinstance(x, torch.fx.Proxy) and x.is_cpu
            and call_dtype(x)[0] == torch.bfloat16)


@torch.jit.unused  # (TorchScript: the layer's script path projects by the convolution)
def project(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
            matmul: bool = True) -> torch.Tensor:
    """The 1x1 convolution of ``x [B, d, H, W]`` by ``weight [out, d, 1, 1]`` (and ``bias [out]``) by the rules of
    the module's docstring: as a matmul where ``matmul`` and :func:`as_matmul`, in float32 where :func:`in_float32`,
    else the convolution. (Under torch.compile the layer projects each of its three parts by it, ``matmul=False``:
    there a convolution's backward is one operator where a matmul's is two, and a compiled bfloat16 training step
    was no faster with the matmul on Zen 5.)"""
    if matmul and as_matmul(x):
        b, d, h, w = x.shape
        out = weight.shape[0]
        # (bmm of the weight expanded over the batch: matmul's [out, d] @ [B, d, n] computes x^T W^T and copies the
        # transposed result back; autocast casts both to bfloat16)
        y = torch.bmm(weight.reshape(1, out, d).expand(b, out, d), x.reshape(b, d, h * w))
        if bias is not None:
            y = y + bias.to(y.dtype).unsqueeze(-1)
        return y.view(b, out, h, w)
    if in_float32(x):
        autocast = torch.is_autocast_enabled('cpu')
        with torch.autocast('cpu', enabled=False):
            y = F.conv2d(x.float(), weight.float(), None if bias is None else bias.float())
        return y if autocast else y.to(x.dtype)  # (bfloat16 tensors, no autocast: the norms after are bfloat16)
    return F.conv2d(x, weight, bias)


class Projection(nn.Conv2d):
    """A 1x1 convolution ``d -> out`` (no padding, stride 1, one group) by :func:`project`'s rules."""

    def __init__(self, in_channels: int, out_channels: int, bias: bool = False, device=None, dtype=None):
        super().__init__(in_channels, out_channels, 1, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # (TorchScript: the convolution; a scripted model loads without this package)
            return self._conv_forward(x, self.weight, self.bias)
        return self._project(x)

    @torch.jit.unused
    def _project(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias)
