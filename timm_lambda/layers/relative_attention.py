"""Self-attention baselines of LambdaNetworks Table 4 with relative position logits, as 3x3-conv drop-ins.

* :func:`rel_to_abs`, :func:`relative_logits_1d`: the memory-efficient relative logits of Attention
  Augmented Convolutional Networks (Bello et al. 2019, section 3.1.1 and Fig. 7): ``q_i . r[j - i]`` for
  every query ``i`` and key ``j`` of one axis from the ``[L, 2L - 1]`` products with the embedding table,
  shifted to absolute indexing by one pad and two reshapes (no ``[L, L, d]`` gather).
* :class:`RelPosSelfAttention2d`: global multi-head self-attention over the whole feature map with 2-D
  relative logits ``l_ij = q_i . (k_j + r^H[j_y - i_y] + r^W[j_x - i_x]) / sqrt(d_k^h)`` (AA eq. 3), one
  height and one width table per layer, shared by the heads. It is timm's
  :class:`timm.layers.bottleneck_attn.BottleneckAttn` (same parameters and names, so a BoTNet layer's weights load) with
  three differences: the tables cover inputs of *up to* ``feat_size`` (the central rows serve smaller
  inputs; timm requires exactly ``feat_size``), the relative logits are added in place by broadcasting
  (timm materialises two more ``[HW, HW]`` tensors per head), and a stride of 2 is a 3x3 average pool
  after the attention (timm: 2x2, which disagrees with a strided 3x3 convolution on odd sizes).
* :class:`AxialSelfAttention2d`: axial attention (Ho et al. 2019; Wang et al. 2020, Axial-DeepLab): a
  height-axis pass then a width-axis pass of multi-head attention over the whole column / row, each with
  1-D relative logits. Axial-DeepLab's position-sensitive terms for keys and values, its gating and its
  batch norms inside the layer are not reproduced (timm has no axial layer).
* :class:`LocalSelfAttention2d`: local self-attention over the ``k x k`` neighbourhood of every pixel
  (Ramachandran et al. 2019, "stand-alone self-attention", k = 7). It is timm's
  :class:`timm.layers.halo_attn.HaloAttn` with ``block_size=1, halo_size=k // 2`` (query blocks of one pixel with
  overlapping ``k x k`` memory blocks, the implementation LambdaNetworks footnote 10 describes). Where it
  differs from SASA: the relative logits are ``q . (r^H + r^W)`` with full-depth height and width tables
  (SASA concatenates a row and a column embedding of half the depth each), only the content logits are
  scaled by ``d^-1/2`` (timm's default; SASA scales neither), border windows contain zero-padded keys and
  values that are not masked out, and HaloAttn's tables have ``2k - 1`` rows of which a one-pixel block uses
  ``k``. A stride of 2 is the same 3x3 average pool after the attention.

Size-dependent code sits in :func:`relative_table`, :func:`upsample_to` and :func:`nonempty_batch`, FX leaves
(``torch.fx.wrap`` here, :func:`timm.layers.register_notrace_function` for timm's feature extraction), so an FX
graph runs at every input size; the modules are TorchScript-scriptable. The global and axial layers have no op that
makes torch.export guard on a size of 1 (batch, height, width) under ``backed_size_oblivious``: heads are folded into
the batch by copies and views (:func:`heads_to_batch`), products are ``bmm`` (docs/execution_modes.md).
"""
import types
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function
from timm.layers.bottleneck_attn import BottleneckAttn
from timm.layers.halo_attn import HaloAttn
from timm.layers.weight_init import trunc_normal_
from torch import nn

from .checks import check_heads, check_ratio, check_stride, to_int, to_pair
from .dilation import batch_to_space, check_dilation, space_to_batch
from .execution import compiled_fresh_copy, compiling, contiguous
from .pooling import downsample_pool

__all__ = ['rel_to_abs', 'relative_logits_1d', 'relative_table', 'upsample_to',
           'RelPosSelfAttention2d', 'AxialSelfAttention2d', 'LocalSelfAttention2d']


def rel_to_abs(x: torch.Tensor) -> torch.Tensor:
    """``[N, L, 2L - 1]`` logits against relative offsets ``-(L-1) .. L-1`` to ``[N, L, L]`` against
    absolute key positions: ``out[n, i, j] = x[n, i, j - i + L - 1]`` (AA paper Fig. 7: pad a column,
    flatten, pad ``L - 1``, reshape to ``[L + 1, 2L - 1]`` and keep the first ``L`` rows, last ``L`` columns)."""
    n, length, _ = x.shape
    x = F.pad(x, [0, 1]).view(n, 2 * length * length)  # views of the padded (new, contiguous) tensors
    x = F.pad(x, [0, length - 1]).view(n, length + 1, 2 * length - 1)
    return x.narrow(1, 0, length).narrow(2, length - 1, length)


def relative_logits_1d(q: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
    """Relative logits along the last spatial axis: ``q [N, A, L, d]`` (``A`` rows of ``L`` queries) and
    ``rel [2L - 1, d]`` (row ``t`` embeds the offset ``t - (L - 1)`` = key - query) give
    ``out[n, a, i, j] = q[n, a, i] . rel[j - i + L - 1]``, shape ``[N, A, L, L]``."""
    n, a, length, d = q.shape
    # torch.matmul's own fold of q into one mm (it copies a non-contiguous q), spelled out: inside torch.export the
    # matmul's reshape guards on sizes of 1 (backed_size_oblivious included), the copy and views do not
    logits = torch.mm(contiguous(q).view(n * a * length, d), rel.t())  # [N A L, 2L - 1]
    return rel_to_abs(logits.view(n * a, length, 2 * length - 1)).unflatten(0, [n, a])


def relative_table(table: torch.Tensor, length: int, name: str) -> torch.Tensor:
    """The ``2 length - 1`` central rows of a ``[2 R - 1, d]`` relative table, for an axis of ``length``
    positions; a ValueError naming ``img_size`` if ``length > R``. An FX leaf (size logic at call time)."""
    radius = (table.shape[0] + 1) // 2
    if length > radius:
        raise ValueError(name + ': input axis of ' + str(length) + ' positions is longer than the ' + str(radius)
                         + ' its relative position table was built for; build the model with a larger img_size '
                         '(the largest input height/width it will see)')
    return table[radius - length:radius + length - 1]


def upsample_to(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Bilinear resize of ``x`` to the spatial size of ``ref`` (align_corners=False). An FX leaf."""
    return F.interpolate(x, size=[ref.shape[-2], ref.shape[-1]], mode='bilinear', align_corners=False)


def renamed(fn, name: str):
    """A copy of the function ``fn`` named ``name``."""
    out = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    out.__qualname__, out.__doc__ = name, fn.__doc__
    return out


def nonempty_batch(x: torch.Tensor) -> torch.Tensor:
    """``x``, or one zero sample when its batch is empty (timm's HaloAttn reshapes with ``-1``, which an
    empty batch cannot infer); the caller keeps the first ``x.shape[0]`` outputs."""
    B, C, H, W = x.shape
    if B == 0:
        return torch.cat([x, x.new_zeros(1, C, H, W)])
    return x


def heads_to_batch(qkv: torch.Tensor, start: int, heads: int, depth: int) -> torch.Tensor:
    """Channels ``start .. start + heads depth`` of a flattened projection ``[B, C, n]`` as ``[B heads, depth, n]``
    (head-major channels): a copy, as ``reshape`` makes of a channel slice (none at ``B = 1``), by ``contiguous``
    and views. A reshape of the slice makes torch.export guard on sizes of 1, batch, height and width, even under
    ``backed_size_oblivious``; inside an export ``contiguous`` always copies (docs/execution_modes.md)."""
    B, _, n = qkv.shape
    return contiguous(qkv.narrow(1, start, heads * depth).unflatten(1, [heads, depth])).view(B * heads, depth, n)


def nchw_copy(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``[B, HW, heads, depth]`` (any strides) as a new contiguous ``[B, heads depth, H, W]``, for torch.compile:
    its last op is a copy, not a view. The next layer saves its input for backward, and inductor orders the strides
    of a saved view by sympy comparisons that it cannot decide when a square map's ``H W = s**2`` is split back into
    ``(s, s**2 // s)`` (torch's FloorDiv does not simplify that; B = 1: ``128*s**2 < 128*s``, an InductorError
    with ``dynamic=True``, issue 51). Copies by ``clone``, which the trace always records (``contiguous()`` records
    nothing where the fake tensor looks contiguous, as a batch-1 map of 1 x 1 symbolic size can); the map is split
    and the channels merged only in views of a contiguous copy (a reshape of ``x`` itself merges heads and depth of
    different strides: at batch 1 with a symbolic ``H W`` the trace recorded it as a view of odd symbolic sizes,
    ``2*(2//w)`` channels for 4); inductor fuses the two copies."""
    B, _, heads, depth = x.shape
    x = x.clone(memory_format=torch.contiguous_format).view(B, height, width, heads * depth)
    return x.permute(0, 3, 1, 2).clone(memory_format=torch.contiguous_format)


def split_heads(x: torch.Tensor, start: int, heads: int, depth: int) -> torch.Tensor:
    """Channels ``start .. start + heads depth`` of ``[B, C, H, W]`` as a view ``[B, heads, depth, H, W]``."""
    return x.narrow(1, start, heads * depth).unflatten(1, [heads, depth])


torch.fx.wrap('relative_table')
torch.fx.wrap('upsample_to')
torch.fx.wrap('nonempty_batch')
torch.fx.wrap('space_to_batch')
torch.fx.wrap('batch_to_space')
register_notrace_function(relative_table)
register_notrace_function(upsample_to)
register_notrace_function(nonempty_batch)


def add_relative_logits_2d(attn: torch.Tensor, q: torch.Tensor, table_h: torch.Tensor, table_w: torch.Tensor,
                           height: int, width: int, name: str) -> torch.Tensor:
    """``attn [N, HW, HW] += q_i . (r^H[j_y - i_y] + r^W[j_x - i_x])`` for row-major positions, in place;
    ``q [N, HW, d]``, tables ``[2 R - 1, d]`` with ``R >= H`` (height) and ``R >= W`` (width)."""
    n, hw, d = q.shape
    q2 = q.unflatten(1, [height, width])
    logits_w = relative_logits_1d(q2, relative_table(table_w, width, name))  # [N, H, W(x), W(x')]
    logits_h = relative_logits_1d(q2.transpose(1, 2), relative_table(table_h, height, name))  # [N, W, H, H']
    # in place (two [N, HW, HW] temporaries less); chained so that an FX graph keeps both additions
    attn = attn.view(n, height, width, height, width).add_(
        logits_w.unsqueeze(3)).add_(  # [N, H(y), W(x), 1, W(x')]: the same for every key row y'
        logits_h.transpose(1, 2).unsqueeze(4))  # [N, H(y), W(x), H(y'), 1]: the same for every key column x'
    return attn.view(n, hw, hw)


class RelPosSelfAttention2d(BottleneckAttn):
    """Global multi-head self-attention with 2-D relative position logits (AA eq. 3-4), any size up to
    ``feat_size``.

    timm's :class:`~timm.layers.BottleneckAttn` (BoTNet's layer; its relative logits are the AA paper's):
    same ``qkv`` projection (no bias), ``pos_embed.height_rel``/``width_rel`` tables of ``2 H_max - 1`` and
    ``2 W_max - 1`` rows shared by the heads, the same initialisation; both the content and the position
    logits are scaled by ``d_k^h ** -0.5`` (AA eq. 4; timm's ``scale_pos_embed=True``). Differences from
    timm's forward: see the module docstring (inputs up to ``feat_size``, in-place logits, 3x3 pool).

    Args:
        dim: input channels.
        dim_out: total value depth (output channels), default ``dim``.
        feat_size: (H, W) of the largest input (sizes the relative tables).
        stride: 1, or 2 for 3x3 average pooling with stride 2 after the attention.
        num_heads: heads ``N_h``; must divide ``dim_out``.
        dim_head: key/query depth per head ``d_k^h`` (default ``dim_out * qk_ratio / num_heads``).
        qk_ratio: total key depth relative to ``dim_out`` when ``dim_head`` is not given.
        qkv_bias: bias in the q/k/v projection.
        device, dtype: factory kwargs.

    Shapes: ``[B, dim, H, W] -> [B, dim_out, ceil(H / stride), ceil(W / stride)]`` for ``H, W <= feat_size``.
    """

    def __init__(
            self,
            dim: int,
            dim_out: Optional[int] = None,
            feat_size: Optional[Tuple[int, int]] = None,
            stride: int = 1,
            num_heads: int = 8,
            dim_head: Optional[int] = None,
            qk_ratio: float = 1.0,
            qkv_bias: bool = False,
            device=None,
            dtype=None,
    ):
        dim = to_int(dim, 'dim')
        dim_out = to_int(dim if dim_out is None else dim_out, 'dim_out')
        num_heads = check_heads(num_heads, dim_out, 'num_heads')
        if feat_size is None:
            raise ValueError('feat_size=(H, W) of the largest input is required: it sizes the relative tables')
        feat_size = to_pair(feat_size, 'feat_size')
        stride = check_stride(stride)
        dim_head = None if dim_head is None else to_int(dim_head, 'dim_head')
        qk_ratio = check_ratio(qk_ratio, 'qk_ratio')
        super().__init__(dim, dim_out, feat_size=feat_size, stride=1, num_heads=num_heads, dim_head=dim_head,
                         qk_ratio=qk_ratio, qkv_bias=bool(qkv_bias), scale_pos_embed=True, device=device, dtype=dtype)
        self.pool = downsample_pool(stride)
        self.stride = stride
        self.feat_size = feat_size

    def extra_repr(self) -> str:
        return (f'num_heads={self.num_heads}, dim_head_qk={self.dim_head_qk}, dim_head_v={self.dim_head_v}, '
                f'feat_size={self.feat_size}, stride={self.stride}')

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        qkv = self.qkv(x).flatten(2)  # [B, 2 dim_out_qk + dim_out_v, HW]
        q = heads_to_batch(qkv, 0, self.num_heads, self.dim_head_qk).transpose(-1, -2) * self.scale  # [BN, HW, dk]
        k = heads_to_batch(qkv, self.dim_out_qk, self.num_heads, self.dim_head_qk)  # [BN, dk, HW]
        v = heads_to_batch(qkv, 2 * self.dim_out_qk, self.num_heads, self.dim_head_v).transpose(-1, -2)
        # bmm, the kernel torch.matmul runs on 3-D operands (its decomposition reshapes them: export guards)
        attn = add_relative_logits_2d(torch.bmm(q, k), q, self.pos_embed.height_rel, self.pos_embed.width_rel, H, W,
                                      'RelPosSelfAttention2d')
        attn = attn.softmax(dim=-1)
        out = torch.bmm(attn, v)  # [BN, HW, dv]
        if not torch.jit.is_scripting() and compiling():
            return self.pool(nchw_copy(out.view(B, self.num_heads, H * W, self.dim_head_v).transpose(1, 2), H, W))
        return self.pool(contiguous(out.transpose(-1, -2)).view(B, self.dim_out_v, H, W))


class AxialAttention1d(nn.Module):
    """Multi-head self-attention along the width axis of ``[B, C, H, W]`` (every row on its own) with 1-D
    relative logits ``q_i . (k_j + r[j - i]) / sqrt(d_k^h)``; the table has ``2 length - 1`` rows."""

    def __init__(self, dim: int, dim_out: int, length: int, num_heads: int, dim_head_qk: int,
                 qkv_bias: bool = False, device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.num_heads = num_heads
        self.dim_head_qk = dim_head_qk
        self.dim_head_v = dim_out // num_heads
        self.dim_out_qk = num_heads * dim_head_qk
        self.dim_out_v = dim_out
        self.scale = dim_head_qk ** -0.5
        self.length = length
        self.qkv = nn.Conv2d(dim, 2 * self.dim_out_qk + self.dim_out_v, 1, bias=qkv_bias, **dd)
        self.rel = nn.Parameter(torch.empty(2 * length - 1, dim_head_qk, **dd))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        trunc_normal_(self.qkv.weight, std=self.qkv.weight.shape[1] ** -0.5)  # fan-in, as timm's attention layers
        trunc_normal_(self.rel, std=self.scale)

    def extra_repr(self) -> str:
        return f'num_heads={self.num_heads}, dim_head_qk={self.dim_head_qk}, length={self.length}'

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        nh, dk, dv = self.num_heads, self.dim_head_qk, self.dim_head_v
        n = B * nh
        qkv = self.qkv(x)
        # each row of each head a bmm batch entry: one copy per operand, the one torch.matmul makes of permuted
        # operands, by contiguous() and views (torch.export guards on sizes of 1 in reshapes and in matmul's
        # decomposition, backed_size_oblivious included)
        q = contiguous(split_heads(qkv, 0, nh, dk).permute(0, 1, 3, 4, 2)).view(n * H, W, dk) * self.scale
        k = contiguous(split_heads(qkv, self.dim_out_qk, nh, dk).permute(0, 1, 3, 2, 4)).view(n * H, dk, W)
        v = contiguous(split_heads(qkv, 2 * self.dim_out_qk, nh, dv).permute(0, 1, 3, 4, 2)).view(n * H, W, dv)
        rel = relative_logits_1d(q.view(n, H, W, dk), relative_table(self.rel, W, 'AxialSelfAttention2d'))
        attn = torch.bmm(q, k).view(n, H, W, W) + rel  # [N, H, W, W]
        out = torch.bmm(attn.softmax(dim=-1).view(n * H, W, W), v)  # [N H, W, dv]
        return contiguous(out.view(B, nh, H, W, dv).permute(0, 1, 4, 2, 3)).view(B, self.dim_out_v, H, W)


class AxialSelfAttention2d(nn.Module):
    """Axial self-attention: attention along every column (height axis), then along every row (width axis).

    Each pass is multi-head attention over the whole axis with 1-D relative logits and its own q/k/v
    projection; memory ``Theta(b h n (H + W))`` instead of ``Theta(b h n^2)``.

    Args:
        dim: input channels.
        dim_out: output channels (value depth of both passes), default ``dim``.
        feat_size: (H, W) of the largest input (sizes the relative tables).
        stride: 1, or 2 for 3x3 average pooling with stride 2 after the attention.
        num_heads: heads; must divide ``dim_out``.
        qk_ratio: total query/key depth relative to ``dim_out`` (default 0.5, Axial-DeepLab's choice).
        qkv_bias: bias in the q/k/v projections.
        norm_layer: accepted for the mixer interface; the layer has no normalisation of its own.
        device, dtype: factory kwargs.
    """

    def __init__(self, dim: int, dim_out: Optional[int] = None, feat_size: Optional[Tuple[int, int]] = None,
                 stride: int = 1, num_heads: int = 8, qk_ratio: float = 0.5, qkv_bias: bool = False,
                 norm_layer=None, device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        dim = to_int(dim, 'dim')
        dim_out = to_int(dim if dim_out is None else dim_out, 'dim_out')
        num_heads = check_heads(num_heads, dim_out, 'num_heads')
        if feat_size is None:
            raise ValueError('feat_size=(H, W) of the largest input is required: it sizes the relative tables')
        feat_size = to_pair(feat_size, 'feat_size')
        qk_ratio = check_ratio(qk_ratio, 'qk_ratio')
        dim_head_qk = max(1, int(dim_out * qk_ratio) // num_heads)
        self.stride = check_stride(stride)
        self.feat_size = feat_size
        # the height pass runs on the transposed map: its "width" axis is the height
        self.height_attn = AxialAttention1d(dim, dim_out, feat_size[0], num_heads, dim_head_qk, bool(qkv_bias), **dd)
        self.width_attn = AxialAttention1d(dim_out, dim_out, feat_size[1], num_heads, dim_head_qk, bool(qkv_bias), **dd)
        self.pool = downsample_pool(self.stride)

    def reset_parameters(self) -> None:
        self.height_attn.reset_parameters()
        self.width_attn.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # compiled: each pass's input and output a copy, not a view (issue 51: inductor could not order the strides
        # of the views the convolutions save for backward)
        x = compiled_fresh_copy(self.height_attn(compiled_fresh_copy(x.transpose(2, 3))).transpose(2, 3))
        x = compiled_fresh_copy(self.width_attn(x))
        return self.pool(x)


class LocalSelfAttention2d(HaloAttn):
    """Local self-attention over the ``kernel_size x kernel_size`` neighbourhood of every pixel (SASA).

    timm's :class:`~timm.layers.HaloAttn` with one-pixel query blocks and a halo of ``kernel_size // 2``
    (its forward, parameters and initialisation unchanged; an empty batch runs it on one zero sample and
    keeps none of it, as HaloAttn cannot reshape an empty batch); see the module docstring for where it
    differs from Ramachandran et al. (2019). Serves any input size.

    Args:
        dim: input channels.
        dim_out: output channels (total value depth), default ``dim``.
        stride: 1, or 2 for 3x3 average pooling with stride 2 after the attention.
        num_heads: heads; must divide ``dim_out`` (default 8, SASA).
        kernel_size: odd neighbourhood side >= 3 (default 7, SASA and LambdaNetworks Table 4).
        qk_ratio: total query/key depth relative to ``dim_out``.
        qkv_bias: bias in the q/k/v projections.
        dilation: the neighbourhood on a grid dilated by ``d`` (keys at ``n + d o``), as the dilated 3x3
            convolution of a backbone with output_stride 16 / 8; our extension (SASA has none), computed as the
            attention on each of the ``d x d`` interleaved sub-grids (space-to-batch, :mod:`.dilation`). Needs
            stride 1. With ``qkv_bias`` the padded positions of sizes not divisible by ``d`` hold the bias, not 0.
        device, dtype: factory kwargs.
    """

    def __init__(self, dim: int, dim_out: Optional[int] = None, stride: int = 1, num_heads: int = 8,
                 kernel_size: int = 7, qk_ratio: float = 1.0, qkv_bias: bool = False, dilation: int = 1,
                 device=None, dtype=None):
        dim = to_int(dim, 'dim')
        dim_out = to_int(dim if dim_out is None else dim_out, 'dim_out')
        num_heads = check_heads(num_heads, dim_out, 'num_heads')
        kernel_size = to_int(kernel_size, 'kernel_size', 3)
        if kernel_size % 2 == 0:
            raise ValueError(f'kernel_size must be odd and >= 3, got {kernel_size}')
        stride = check_stride(stride)
        qk_ratio = check_ratio(qk_ratio, 'qk_ratio')
        super().__init__(dim, dim_out, stride=1, num_heads=num_heads, block_size=1, halo_size=kernel_size // 2,
                         qk_ratio=qk_ratio, qkv_bias=bool(qkv_bias), device=device, dtype=dtype)
        # HaloAttn's forward pools its output view: compiled, the pool copies it first (issue 51)
        self.pool = downsample_pool(stride, fresh_input=True)
        self.stride = stride
        self.kernel_size = kernel_size
        self.dilation = check_dilation(dilation)
        if self.dilation > 1 and stride != 1:
            raise ValueError(f'dilation={dilation} needs stride=1, got stride={stride}')

    def extra_repr(self) -> str:
        return (f'num_heads={self.num_heads}, dim_head_qk={self.dim_head_qk}, dim_head_v={self.dim_head_v}, '
                f'kernel_size={self.kernel_size}, stride={self.stride}'
                + (f', dilation={self.dilation}' if self.dilation > 1 else ''))

    # timm's forward, under a name of its own (TorchScript compiles a method by its function's name)
    _halo_forward = renamed(HaloAttn.forward, '_halo_forward')

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dilation > 1:  # the attention of each d x d interleaved sub-grid
            B, _, H, W = x.shape
            xs = space_to_batch(x, self.dilation)
            out = self._halo_forward(nonempty_batch(xs))[:xs.shape[0]]
            return compiled_fresh_copy(batch_to_space(out, self.dilation, H, W))
        # an empty batch gives an empty output; compiled: a copy, not HaloAttn's view (issue 51)
        return compiled_fresh_copy(self._halo_forward(nonempty_batch(x))[:x.shape[0]])
