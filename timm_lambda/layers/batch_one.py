"""The one workaround for a PyTorch CPU bug that makes batch-norm input gradients wrong at batch size 1.

``F.batch_norm`` -> ``reshape(B, C, n)`` -> ``transpose`` -> ``matmul`` hands batch norm's backward a
gradient of shape ``[1, C, H, W]`` with strides like ``(C, 1, W*C, C)``: channels-last by
``is_contiguous(memory_format=torch.channels_last)``, but with a batch stride of ``C`` (legal, since the
batch has one sample). The CPU kernel then computes a wrong input gradient (relative error ~1), in train
and eval mode; at batch 2 the same graph is exact. Seen on torch 2.14.1 (the affected releases are listed
in docs/execution_modes.md, with a torch-only repro in tests/test_batch_one.py).

Every layer of this package whose norm output feeds a reshape goes through :func:`reshape_normed`.
"""
from typing import List

import torch

__all__ = ['reshape_normed']


def reshape_normed(x: torch.Tensor, shape: List[int]) -> torch.Tensor:
    """``x.reshape(shape)`` for ``x`` the output of a norm layer, with the gradient reaching the norm made
    contiguous: autograd's backward of ``view`` is a ``reshape``, which copies a gradient that cannot be
    viewed as one flat vector and then views the flat copy as ``x``'s (contiguous) shape.

    Costs nothing in the forward pass for a contiguous ``x`` (two views); in the backward pass at most one
    copy of the gradient. Every execution mode sees plain reshapes (trace, script, ONNX, export, torch.func).
    """
    return x.reshape(-1).view(shape)
