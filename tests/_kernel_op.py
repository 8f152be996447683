"""The tiled form's kernels (``backends.tiled_kernels``: the layouts of the comment above it) as an autograd function,
run by the backend the table chooses for the call: what the lambda operator calls inside (timm_lambda's
position_lambda/fused.py), tested on its own against tests/reference.py::tiled_operator_reference."""
import torch

from timm_lambda.layers.position_lambda import backends


def _backend(q, v, table, step) -> str:
    b, _, _, ho, wo = q.shape
    return backends.choose(backends.Call('tiled', q.device.type, q.dtype, step, b * ho * wo,
                                         v.shape[2] <= table.shape[2] and v.shape[3] <= table.shape[3]))


class _KernelCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, v, table, step, content):
        ctx.backend = _backend(q, v, table, step)
        ctx.step = step
        ctx.save_for_backward(q, v, table, content)
        y = backends.tiled_kernels(ctx.backend)[0](q, v, table, step, content)
        backends.record('tiled', ctx.backend, q)
        return y

    @staticmethod
    def backward(ctx, gy):
        q, v, table, content = ctx.saved_tensors
        gq, gv, gt, gc = backends.tiled_kernels(ctx.backend)[1](gy, q, v, table, ctx.step, content)
        return gq, gv, gt, None, None if content is None else gc


def kernel_call(q, v, table, step, content=None):
    """``y [B, h V, Ho, Wo]`` of the tiled kernels for ``q [B, h, c, Ho, Wo]``, ``v [B, u V, H, W]``, ``table [c, u,
    K_h, K_w]`` and an optional content lambda ``[B, c, V]``; differentiable once."""
    return _KernelCall.apply(q, v, table, step, content)
