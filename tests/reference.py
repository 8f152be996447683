"""Naive float64 references for the lambda layer family, written straight from the paper.

These loop over query positions ``n`` and evaluate equations 1-2 of LambdaNetworks directly::

    lambda_n = sum_m (softmax_m(K)_m + e_nm) v_m^T            (eq. 1, intra-depth summed, Fig. 8)
    y_n      = concat_h(lambda_n^T q_n^h)                      (eq. 2)

They read the layers' raw parameters only (the 1x1 projection weight split into W_Q / W_K / W_V,
batch norm running statistics applied as an affine map, i.e. eval mode, and the raw relative
embedding table indexed by ``m - n``). They never call the layers' ``dense()`` / ``kernel()``
helpers or any of their forward code, so an indexing bug there cannot cancel out here.
"""
import torch
from torch import nn

__all__ = ['lambda_layer_reference', 'masked_lambda_reference', 'multihead_lambda_reference']


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


def _rel_embedding(table: torch.Tensor, ny: int, nx: int, my: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
    """e_nm for one query n=(ny, nx) and context positions m=(my, mx) from the raw table.

    ``table`` is [k, u, Rh, Rw] centred on offset (0, 0); offsets outside it (outside the
    scope) give zero embeddings. Returns [m, k, u].
    """
    k, u, rh, rw = table.shape
    ch, cw = (rh - 1) // 2, (rw - 1) // 2
    dy, dx = my - ny, mx - nx  # m - n
    inside = (dy.abs() <= ch) & (dx.abs() <= cw)
    e = torch.zeros(my.numel(), k, u, dtype=table.dtype)
    iy, ix = (dy + ch)[inside], (dx + cw)[inside]
    e[inside] = table[:, :, iy, ix].permute(2, 0, 1)
    return e


def _avg_pool_3x3_s2(y: torch.Tensor) -> torch.Tensor:
    """3x3 average pool, stride 2, padding 1, averaging the in-image positions only (TF 'SAME' borders)."""
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
            out[:, :, i, j] = acc / count
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
                E = _rel_embedding(table, ny, nx, py, px)  # [m, k, u]
                lam += torch.einsum('mku,muv->kv', E, V)
            out = torch.einsum('kv,hk->hv', lam, Q[n])  # lambda_n^T q_n^h
            y[b, :, ny, nx] = out.reshape(h * v)
    if layer.stride == 2:
        y = _avg_pool_3x3_s2(y)
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
