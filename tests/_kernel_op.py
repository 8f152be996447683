"""The tiled form's kernels of a backend (``Tiled.tiled_forward`` / ``tiled_backward``: the layouts of
timm_lambda's position_lambda/fused.py) as an autograd function, run by the backend the registry chooses for the call
with its own decisions: what the lambda operator calls inside, tested on its own against
tests/reference.py::tiled_operator_reference."""
import torch

from timm_lambda.layers.position_lambda import Plan, backends


def kernel_plan(q, v, table, step, form: str = 'tiled') -> Plan:
    """The plan of a kernel call on ``q [B, h, c, Ho, Wo]``, ``v``, ``table [c, u, K_h, K_w]`` at ``step``."""
    b, h, c, ho, wo = q.shape
    u, kh, kw = table.shape[1], table.shape[2], table.shape[3]
    height, width = v.shape[2], v.shape[3]
    call = backends.Call(form, q.device.type, q.dtype, 1, b * ho * wo if q.is_cuda else 0,
                         2 * height - 1 <= kh and 2 * width - 1 <= kw, height, width, kh, kw, c, u,
                         v.shape[1] // u, h)
    name = backends.choose(call)
    backend = backends.get(name)  # (its decisions for a kernel call at this step, query depth and window)
    return Plan(form, name, 'eager', '', q.dtype, backend.kernel_dtype(q.dtype),
                backend.kernel_tiling(q.device.type, q.dtype, step, c, kw), False, step, False, 'softmax', False)


class _KernelCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, v, table, step, content):
        ctx.plan = kernel_plan(q, v, table, step)
        ctx.step = step
        ctx.save_for_backward(q, v, table, content)
        y = backends.get(ctx.plan.backend).tiled_forward(ctx.plan, q, v, table, step, content)
        backends.record('tiled', ctx.plan.backend, q.device.type, q.dtype, 'forward')
        return y

    @staticmethod
    def backward(ctx, gy):
        q, v, table, content = ctx.saved_tensors
        gq, gv, gt, gc = backends.get(ctx.plan.backend).tiled_backward(ctx.plan, gy, q, v, table, ctx.step, content)
        backends.record('tiled', ctx.plan.backend, q.device.type, q.dtype, 'backward')
        return gq, gv, gt, None, None if content is None else gc


def kernel_call(q, v, table, step, content=None):
    """``y [B, h V, Ho, Wo]`` of the tiled kernels for ``q [B, h, c, Ho, Wo]``, ``v [B, u V, H, W]``, ``table [c, u,
    K_h, K_w]`` and an optional content lambda ``[B, c, V]``; differentiable once."""
    return _KernelCall.apply(q, v, table, step, content)
