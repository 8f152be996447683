"""Naive float64 references for the lambda layer family, written straight from the paper.

These loop over query positions ``n`` and evaluate equations 1-2 of LambdaNetworks directly::

    lambda_n = sum_m (softmax_m(K)_m + e_nm) v_m^T            (eq. 1, intra-depth summed, Fig. 8)
    y_n      = concat_h(lambda_n^T q_n^h)                      (eq. 2)

They read the layers' raw parameters only (the 1x1 projection weight split into W_Q / W_K / W_V,
batch norm running statistics applied as an affine map, i.e. eval mode, and the raw relative
embedding table indexed by ``m - n``). They never call the layers' forward code or any function of
``timm_lambda.layers`` (the position-lambda implementations, the relative-embedding indexing), so an
indexing bug there cannot cancel out here.
"""
from typing import Optional

import torch
from torch import nn

__all__ = ['lambda_layer_reference', 'masked_lambda_reference', 'multihead_lambda_reference', 'position_term_reference',
           'dli14_lambda_reference', 'dli14_resnet_reference']


def _embedding_of(layer) -> nn.Module:
    """The RelativePositionEmbedding a layer uses (its own or a shared one), read for its raw table."""
    return layer.pos_embedding


def _bn_eval(norm: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """Batch norm in eval mode as an affine map over the channel axis (last axis of ``t``)."""
    if isinstance(norm, nn.Identity):
        return t
    assert isinstance(norm, nn.BatchNorm2d) and not norm.training, 'reference assumes BN in eval mode'
    mean = norm.running_mean.double()
    var = norm.running_var.double()
    scale = norm.weight.double() / torch.sqrt(var + norm.eps)
    return (t - mean) * scale + norm.bias.double()


def _normalize_keys(keys: torch.Tensor, key_norm: str) -> torch.Tensor:
    """Normalise ``keys`` [m, ...] over the context axis 0 (Table 11)."""
    if key_norm == 'softmax':
        e = torch.exp(keys - keys.max(dim=0, keepdim=True).values)
        return e / e.sum(dim=0, keepdim=True)
    if key_norm == 'l2':
        return keys / keys.pow(2).sum(dim=0, keepdim=True).sqrt().clamp_min(1e-12)
    assert key_norm == 'none'
    return keys


def _rel_embedding(table: torch.Tensor, ny: int, nx: int, my: torch.Tensor, mx: torch.Tensor,
                   dilation: int = 1) -> torch.Tensor:
    """e_nm for one query n=(ny, nx) and context positions m=(my, mx) from the raw table.

    ``table`` is [k, u, Rh, Rw] centred on offset (0, 0); offsets outside it (outside the
    scope) give zero embeddings. With ``dilation`` d, only m = n + d * o with o inside the table
    has an embedding, R[o] (a dilated local scope). Returns [m, k, u].
    """
    k, u, rh, rw = table.shape
    ch, cw = (rh - 1) // 2, (rw - 1) // 2
    dy, dx = my - ny, mx - nx  # m - n
    on_grid = (dy % dilation == 0) & (dx % dilation == 0)
    dy, dx = torch.div(dy, dilation, rounding_mode='floor'), torch.div(dx, dilation, rounding_mode='floor')
    inside = on_grid & (dy.abs() <= ch) & (dx.abs() <= cw)
    e = torch.zeros(my.numel(), k, u, dtype=table.dtype)
    iy, ix = (dy + ch)[inside], (dx + cw)[inside]
    e[inside] = table[:, :, iy, ix].permute(2, 0, 1)
    return e


def _avg_pool_3x3_s2(y: torch.Tensor, count_include_pad: bool = False) -> torch.Tensor:
    """3x3 average pool, stride 2, padding 1, averaging the in-image positions only (TF 'SAME' borders), or,
    with ``count_include_pad``, dividing every window's in-image sum by 9 (the zero padding counted)."""
    B, C, H, W = y.shape
    Ho, Wo = (H + 1) // 2, (W + 1) // 2
    out = torch.zeros(B, C, Ho, Wo, dtype=y.dtype)
    for i in range(Ho):
        for j in range(Wo):
            acc, count = torch.zeros(B, C, dtype=y.dtype), 0
            for a in range(2 * i - 1, 2 * i + 2):
                for b in range(2 * j - 1, 2 * j + 2):
                    if 0 <= a < H and 0 <= b < W:
                        acc, count = acc + y[:, :, a, b], count + 1
            out[:, :, i, j] = acc / (9 if count_include_pad else count)
    return out


@torch.no_grad()
def lambda_layer_reference(layer, x: torch.Tensor) -> torch.Tensor:
    """Float64 per-query reference of :class:`timm_lambda.layers.LambdaLayer` (BN in eval mode)."""
    h, k, u, v = layer.heads, layer.dim_k, layer.dim_u, layer.dim_v
    x = x.detach().double()
    B, d, H, W = x.shape
    w = layer.qkv.weight.detach().double()[:, :, 0, 0]  # [out, d]
    w_q, w_k, w_v = w[:h * k], w[h * k:h * k + k * u], w[h * k + k * u:]
    assert w_v.shape[0] == v * u
    table = _embedding_of(layer).weight.detach().double() if layer.position else None
    bias = getattr(layer, 'pos_bias', None)
    bias = bias.detach().double() if bias is not None else None  # [k]: lambda^p_n[k, :] += b_k
    pos = torch.arange(H * W)
    py, px = pos // W, pos % W  # context coordinates, row-major like the NCHW flattening
    y = torch.zeros(B, h * v, H, W, dtype=torch.float64)
    for b in range(B):
        X = x[b].reshape(d, H * W).t()  # [n, d]
        Q = _bn_eval(layer.norm_q, X @ w_q.t()).reshape(H * W, h, k)
        K = (X @ w_k.t()).reshape(H * W, u, k)  # channel = u_idx * k + k_idx
        V = _bn_eval(layer.norm_v, X @ w_v.t()).reshape(H * W, u, v)  # channel = u_idx * v + v_idx
        Kbar = _normalize_keys(K, layer.key_norm)  # over m, per (u, k)
        for n in range(H * W):
            ny, nx = divmod(n, W)
            lam = torch.zeros(k, v, dtype=torch.float64)
            if layer.content:
                lam += torch.einsum('muk,muv->kv', Kbar, V)
            if layer.position:
                E = _rel_embedding(table, ny, nx, py, px, getattr(layer, 'dilation', 1))  # [m, k, u]
                lam += torch.einsum('mku,muv->kv', E, V)
                if bias is not None:
                    lam += bias[:, None]
            out = torch.einsum('kv,hk->hv', lam, Q[n])  # lambda_n^T q_n^h
            y[b, :, ny, nx] = out.reshape(h * v)
    if layer.stride == 2:
        y = _avg_pool_3x3_s2(y, getattr(layer, 'pool_count_include_pad', False))
    return y


@torch.no_grad()
def masked_lambda_reference(layer, x: torch.Tensor, mask=None) -> torch.Tensor:
    """Float64 per-query reference of the masked lambda layer (Fig. 6).

    Keys are softmax-normalised over each query's own context C_n = {m : mask[n, m]};
    e_nm = R[m - n] inside the mask (and the local scope), 0 elsewhere.
    """
    B, N, d = x.shape
    h, k, v = layer.heads, layer.dim_k, layer.dim_v
    x = x.detach().double()
    if mask is None:
        idx = torch.arange(N)
        mask = (idx[None, :] <= idx[:, None]) if layer.causal else torch.ones(N, N, dtype=torch.bool)
    mask = mask.bool()
    w_q, w_k, w_v = (m.weight.detach().double() for m in (layer.to_q, layer.to_k, layer.to_v))
    R = layer.rel_emb.detach().double()  # [2 max_len - 1, k], row offset + max_len - 1
    y = torch.zeros(B, N, h * v, dtype=torch.float64)
    for b in range(B):
        Q = (x[b] @ w_q.t()).reshape(N, h, k)
        K, V = x[b] @ w_k.t(), x[b] @ w_v.t()
        for n in range(N):
            ctx = [m for m in range(N) if mask[n, m]]
            lam = torch.zeros(k, v, dtype=torch.float64)
            if ctx:
                Kc = K[ctx]
                Kbar = _normalize_keys(Kc, layer.key_norm)
                lam += Kbar.t() @ V[ctx]
                for j, m in enumerate(ctx):
                    off = m - n
                    if layer.scope is None or abs(off) <= layer.scope // 2:
                        lam += torch.outer(R[off + layer.max_len - 1], V[m])
            y[b, n] = torch.einsum('kv,hk->hv', lam, Q[n]).reshape(h * v)
    return y


@torch.no_grad()
def multihead_lambda_reference(layer, x: torch.Tensor) -> torch.Tensor:
    """Float64 per-query, per-head reference of the multi-head lambda layer (Fig. 7)."""
    h, k, v = layer.heads, layer.dim_k, layer.dim_v
    x = x.detach().double()
    B, d, H, W = x.shape
    w = layer.qkv.weight.detach().double()[:, :, 0, 0]
    w_q, w_k, w_v = w[:h * k], w[h * k:2 * h * k], w[2 * h * k:]
    table = layer.pos_embedding.weight.detach().double()  # [h*k, 1, Rh, Rw]
    pos = torch.arange(H * W)
    py, px = pos // W, pos % W
    y = torch.zeros(B, h * v, H, W, dtype=torch.float64)
    for b in range(B):
        X = x[b].reshape(d, H * W).t()
        Q = _bn_eval(layer.norm_q, X @ w_q.t()).reshape(H * W, h, k)
        K = (X @ w_k.t()).reshape(H * W, h, k)
        V = _bn_eval(layer.norm_v, X @ w_v.t()).reshape(H * W, h, v)
        Kbar = _normalize_keys(K, layer.key_norm)
        for n in range(H * W):
            ny, nx = divmod(n, W)
            E = _rel_embedding(table, ny, nx, py, px)[:, :, 0].reshape(H * W, h, k)  # [m, h, k]
            out = []
            for hh in range(h):
                lam = Kbar[:, hh].t() @ V[:, hh] + E[:, hh].t() @ V[:, hh]  # [k, v]
                out.append(lam.t() @ Q[n, hh])
            y[b, :, ny, nx] = torch.cat(out)
    if isinstance(layer.pool, nn.AvgPool2d):  # stride 2
        y = _avg_pool_3x3_s2(y)
    return y


# --- d-li14/lambda.pytorch conventions, read from their state_dict ------------------------------------
# Their LambdaLayer (lambda_layer.py at commit 646de55) holds ``conv_qkv`` (1x1, no bias; output channels
# split [q: Nh*dk, k: dk*du, v: dv*du]), ``norm_q``/``norm_v`` (BatchNorm2d) and ``lambda_conv =
# Conv3d(du, dk, (1, r, r), padding=(0, r//2, r//2))`` WITH its default bias, applied to the values viewed
# as [N, du, dv, H, W]; stride 2 is ``nn.AvgPool2d(3, 2, padding=1)`` (count_include_pad=True) after the
# layer. Their ResNet is torchvision's ResNet-50 v1.5 layout with ``conv2`` the lambda layer.
# Written from those definitions (conv3d as cross-correlation), not from timm_lambda's code.


def _bn_eval_sd(sd: dict, prefix: str, t: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Eval-mode BatchNorm from raw state_dict tensors over the channel axis 1 of an NCHW ``t``."""
    shape = (1, -1) + (1,) * (t.dim() - 2)
    mean, var = sd[prefix + 'running_mean'].double(), sd[prefix + 'running_var'].double()
    w, b = sd[prefix + 'weight'].double(), sd[prefix + 'bias'].double()
    return (t - mean.view(shape)) / torch.sqrt(var.view(shape) + eps) * w.view(shape) + b.view(shape)


@torch.no_grad()
def dli14_lambda_reference(sd: dict, prefix: str, x: torch.Tensor, heads: int = 4, dim_k: int = 16,
                           dim_u: int = 1, stride: int = 1) -> torch.Tensor:
    """Float64 per-query reference of one d-li14 lambda layer from its state_dict entries ``prefix + ...``.

    For query n and context m, their lambda convolution contributes ``W[k, u, 0, m - n + c] v_m`` (conv3d is a
    cross-correlation: out[n] = sum_i W[i] in[n + i - c], zero outside the input) plus ``b_k`` once per n:
    lambda_n[k, :] = sum_m softmax_m(K)[k] v_m + sum_{m in scope} W[k, u, 0, m - n + c] v_m + b_k.
    """
    h, k, u = heads, dim_k, dim_u
    x = x.detach().double()
    B, d, H, W = x.shape
    v = d // h
    w = sd[prefix + 'conv_qkv.weight'].double()[:, :, 0, 0]
    assert w.shape == (h * k + k * u + v * u, d)
    w_q, w_k, w_v = w[:h * k], w[h * k:h * k + k * u], w[h * k + k * u:]
    kernel = sd[prefix + 'lambda_conv.weight'].double()  # [k, u, 1, r, r]
    bias = sd[prefix + 'lambda_conv.bias'].double()  # [k]
    r = kernel.shape[-1]
    c = (r - 1) // 2
    y = torch.zeros(B, h * v, H, W, dtype=torch.float64)
    for b in range(B):
        X = x[b].reshape(d, H * W)  # [d, n]
        Q = _bn_eval_sd(sd, prefix + 'norm_q.', (w_q @ X)[None])[0].reshape(h, k, H * W)
        K = (w_k @ X).reshape(u, k, H * W)
        V = _bn_eval_sd(sd, prefix + 'norm_v.', (w_v @ X)[None])[0].reshape(u, v, H * W)
        Kbar = torch.exp(K - K.max(dim=-1, keepdim=True).values)
        Kbar = Kbar / Kbar.sum(dim=-1, keepdim=True)  # softmax over the context positions m
        content = torch.einsum('ukm,uvm->kv', Kbar, V)
        V2 = V.reshape(u, v, H, W)
        for ny in range(H):
            for nx in range(W):
                # context rows my in [y0, y1) (in the image and within the kernel): kernel rows my - ny + c
                y0, y1, x0, x1 = max(0, ny - c), min(H, ny + c + 1), max(0, nx - c), min(W, nx + c + 1)
                e = kernel[:, :, 0, y0 - ny + c:y1 - ny + c, x0 - nx + c:x1 - nx + c]  # [k, u, my, mx]
                lam = content + torch.einsum('kuyx,uvyx->kv', e, V2[:, :, y0:y1, x0:x1]) + bias[:, None]
                y[b, :, ny, nx] = torch.einsum('kv,hk->hv', lam, Q[:, :, ny * W + nx]).reshape(h * v)
    if stride == 2:
        y = _avg_pool_3x3_s2(y, count_include_pad=True)
    return y


@torch.no_grad()
def dli14_resnet_reference(sd: dict, x: torch.Tensor, layers=(3, 4, 6, 3)) -> torch.Tensor:
    """Float64 forward of d-li14's LambdaResNet (torchvision ResNet v1.5 layout, ``conv2`` a lambda layer) in
    eval mode, from their state_dict; the lambda layers by :func:`dli14_lambda_reference`."""
    import torch.nn.functional as F
    sd = {key: t.double() if t.is_floating_point() else t for key, t in sd.items()}
    x = x.detach().double()
    x = F.conv2d(x, sd['conv1.weight'], stride=2, padding=3)
    x = F.max_pool2d(F.relu(_bn_eval_sd(sd, 'bn1.', x)), 3, 2, 1)
    for stage, depth in enumerate(layers, start=1):
        for i in range(depth):
            p = f'layer{stage}.{i}.'
            stride = 2 if stage > 1 and i == 0 else 1
            out = F.relu(_bn_eval_sd(sd, p + 'bn1.', F.conv2d(x, sd[p + 'conv1.weight'])))
            out = dli14_lambda_reference(sd, p + 'conv2.', out, stride=stride)
            out = F.relu(_bn_eval_sd(sd, p + 'bn2.', out))
            out = _bn_eval_sd(sd, p + 'bn3.', F.conv2d(out, sd[p + 'conv3.weight']))
            if p + 'downsample.0.weight' in sd:
                x = _bn_eval_sd(sd, p + 'downsample.1.', F.conv2d(x, sd[p + 'downsample.0.weight'], stride=stride))
            x = F.relu(out + x)
    return F.linear(x.mean(dim=(2, 3)), sd['fc.weight'], sd['fc.bias'])


def position_term_reference(q: torch.Tensor, v: torch.Tensor, table: torch.Tensor, height: int, width: int,
                            stride: int = 1, count_include_pad: bool = False) -> torch.Tensor:
    """The position term ``y_n^h = sum_{u, m in scope(n)} (q_n^h . R[m - n, u]) v_{m, u}`` query by query (eq. 1-2
    with ``e_nm = R[m - n]``), then the 3x3 stride-2 average pool of a downsampling layer; differentiable.

    ``q [B, h, k, n]``, ``v [B, u, V, n]``, ``table [k, u, R_h, R_w]`` centred on offset 0 (a local scope, or a
    global table covering every offset). Returns ``[B, h, V, n_out]``. Each query reads the table rows and the
    value window of its own scope: no gather index, no padding, no blocks.
    """
    B, h, k, n = q.shape
    u, dv = v.shape[1], v.shape[2]
    ch, cw = (table.shape[-2] - 1) // 2, (table.shape[-1] - 1) // 2
    values = v.reshape(B, u, dv, height, width)
    out = []
    for ny in range(height):
        for nx in range(width):
            y0, y1, x0, x1 = max(0, ny - ch), min(height, ny + ch + 1), max(0, nx - cw), min(width, nx + cw + 1)
            e = table[:, :, y0 - ny + ch:y1 - ny + ch, x0 - nx + cw:x1 - nx + cw]  # [k, u, my, mx] = R[m - n]
            lam = torch.einsum('kuyx,buvyx->bkv', e, values[..., y0:y1, x0:x1])  # lambda^p_n
            out.append(torch.einsum('bhk,bkv->bhv', q[..., ny * width + nx], lam))  # (lambda^p_n)^T q_n^h
    y = torch.stack(out, -1) if out else q.new_zeros(B, h, dv, 0)
    if stride == 2:
        y = _avg_pool_3x3_s2(y.reshape(B, h * dv, height, width), count_include_pad)
        return y.reshape(B, h, dv, y.shape[-2] * y.shape[-1])
    return y


def tiled_operator_reference(q: torch.Tensor, v: torch.Tensor, table: torch.Tensor, step: int = 1,
                             content: Optional[torch.Tensor] = None, logits_dtype: Optional[torch.dtype] = None):
    """The tiled operator's contract (``timm_lambda::tiled_position_lambdas``) query by query in float64: query
    ``(oy, ox)`` meets ``v[b, u V + j, step oy + ky - (K_h - 1) // 2, step ox + kx - (K_w - 1) // 2]`` through the
    logit ``q[b, h, :, oy, ox] . table[:, u, ky, kx]`` (zero outside the image), plus ``q . content[b]`` (eq. 2).

    ``q [B, h, c, Ho, Wo]``, ``v [B, u V, H, W]``, ``table [c, u, K_h, K_w]``, ``content [B, c, V]`` -> ``[B, h V, Ho,
    Wo]``. ``logits_dtype``: round each logit to it first (float32 first, then it), as a low-precision matmul rounds
    its output.
    """
    q, v, table = q.double(), v.double(), table.double()
    B, h, c, Ho, Wo = q.shape
    _, u, kh, kw = table.shape
    H, W, V = v.shape[2], v.shape[3], v.shape[1] // u
    values = v.reshape(B, u, V, H, W)
    y = q.new_zeros(B, h, V, Ho, Wo)
    for oy in range(Ho):
        for ox in range(Wo):
            y0, x0 = step * oy - (kh - 1) // 2, step * ox - (kw - 1) // 2
            ky0, ky1 = max(0, -y0), min(kh, H - y0)
            kx0, kx1 = max(0, -x0), min(kw, W - x0)
            if ky1 <= ky0 or kx1 <= kx0:
                continue
            logits = torch.einsum('bhc,cuyx->bhuyx', q[..., oy, ox], table[:, :, ky0:ky1, kx0:kx1])
            if logits_dtype is not None:
                logits = logits.float().to(logits_dtype).double()
            window = values[..., y0 + ky0:y0 + ky1, x0 + kx0:x0 + kx1]
            y[..., oy, ox] = torch.einsum('bhuyx,buvyx->bhv', logits, window)
    if content is not None:
        y = y + torch.einsum('bhcyx,bcv->bhvyx', q, content.double())
    return y.reshape(B, h * V, Ho, Wo)
