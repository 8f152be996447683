"""Masked multi-query lambda layer for 1-D sequences (LambdaNetworks appendix C.2, Fig. 6).

Query ``n`` only sees its sub-context ``C_n = {m : mask[n, m]}`` (causal by default: ``m <= n``)::

    lambda_n = sum_{m in C_n} (softmax_{m in C_n}(k)_m + e_nm) v_m^T ,   y_n = concat_h(lambda_n^T q_n^h)

Keys are normalised over each query's own context only ("Keys should be normalized by only
considering the elements in their contexts", Fig. 6). The mask is shared over the batch, so no
per-example ``n x m`` map is built: contributions ``k_m v_m^T`` are summed with prefix
log-sum-exps (causal: exact for any key magnitude) or a mask contraction (general mask).

Choice: no batch norm on queries and values here (unlike the 2-D layer). Batch statistics over
the sequence would let future positions influence the present in training mode.

Non-finite inputs: a position whose input holds a NaN or Inf is zeroed before the contractions (so
``0 x NaN`` cannot reach queries that do not see it) and every query whose context contains it, or
whose own input is non-finite, outputs NaN. The output at ``n`` depends only on inputs in ``C_n`` and
on ``x_n`` for any input values.
"""
from typing import Optional

import torch
from torch import nn

from .lambda_layer import check_bool, check_choice
from .relative_embedding import to_int

__all__ = ['MaskedLambdaLayer1d']


class MaskedLambdaLayer1d(nn.Module):
    """Masked (causal by default) multi-query lambda layer on ``[B, N, dim]`` sequences.

    Args:
        dim: input width; dim_out: output width (default dim); |v| = dim_out / heads.
        dim_k: query/key depth |k|. heads: number of queries |h|.
        max_len: longest sequence; the relative embedding table covers offsets
            ``[-(max_len - 1), max_len - 1]``.
        scope: None for the whole (masked) context, or an odd local scope for position lambdas.
        causal: default mask ``m <= n`` when ``forward`` is given no mask.
        key_norm: 'softmax' (over each query's context) or 'none'.
    """

    def __init__(self, dim: int, dim_out: Optional[int] = None, dim_k: int = 16, heads: int = 4,
                 max_len: int = 512, scope: Optional[int] = None, causal: bool = True,
                 key_norm: str = 'softmax', device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.dim = to_int(dim, 'dim')
        self.dim_out = to_int(self.dim if dim_out is None else dim_out, 'dim_out')
        self.dim_k, self.heads = to_int(dim_k, 'dim_k'), to_int(heads, 'heads')
        if self.dim_out % heads:
            raise ValueError(f'heads={heads} must divide the output width dim_out={self.dim_out}')
        self.dim_v = self.dim_out // heads
        self.max_len = to_int(max_len, 'max_len')
        if scope is not None:
            scope = to_int(scope, 'scope')
            if scope % 2 == 0:
                raise ValueError(f'scope must be None (whole context) or an odd int >= 1, got {scope}')
        self.scope = scope
        self.causal = check_bool(causal, 'causal')
        self.key_norm = check_choice(key_norm, 'key_norm', ('softmax', 'none'))
        self.to_q = nn.Linear(self.dim, self.heads * self.dim_k, bias=False, **dd)
        self.to_k = nn.Linear(self.dim, self.dim_k, bias=False, **dd)
        self.to_v = nn.Linear(self.dim, self.dim_v, bias=False, **dd)
        self.rel_emb = nn.Parameter(torch.empty(2 * self.max_len - 1, self.dim_k, **dd))  # R[offset + max_len - 1]
        nn.init.normal_(self.rel_emb)
        nn.init.normal_(self.to_k.weight, std=self.dim ** -0.5)
        nn.init.normal_(self.to_v.weight, std=self.dim ** -0.5)
        nn.init.normal_(self.to_q.weight, std=(self.dim_k * self.dim) ** -0.5)

    def _default_mask(self, n: int, device) -> torch.Tensor:
        idx = torch.arange(n, device=device)
        if self.causal:
            return idx[None, :] <= idx[:, None]
        return torch.ones(n, n, dtype=torch.bool, device=device)

    @staticmethod
    def _causal_softmax_lambdas(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """sum_{m<=n} softmax_{m<=n}(k)_m v_m^T for every n, exactly and without overflow/underflow:
        prefix log-sum-exps (``logcumsumexp``) normalise each prefix by its own maximum. Signed
        values are split as v = v+ - v- so both parts go through the log domain. [b,n,k] x [b,n,v] ->
        [b,n,k,v]."""
        tiny = torch.finfo(k.dtype).tiny
        log_den = torch.logcumsumexp(k, dim=1).unsqueeze(-1)  # [b, n, k, 1]
        out = 0
        for sign, part in ((1.0, v.clamp_min(0)), (-1.0, (-v).clamp_min(0))):
            logits = k.unsqueeze(-1) + part.clamp_min(tiny).log().unsqueeze(-2)  # [b, m, k, v]
            out = out + sign * (torch.logcumsumexp(logits, dim=1) - log_den).exp()
        return out

    @staticmethod
    def _masked_softmax_lambdas(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Same for a general [n, m] mask. Shifted by the global maximum over m (detached; it cancels),
        contracted with the mask: no per-example n x m map. If some query's context underflows under
        that shift (keys ~80+ below the maximum), that batch is recomputed exactly with per-query
        maxima over the masked logits ([b, n, m, k], the fallback pays that memory)."""
        ek = (k - k.amax(dim=1, keepdim=True).detach()).exp()
        maskf = mask.to(ek.dtype)
        num = torch.einsum('nm,bmk,bmv->bnkv', maskf, ek, v)
        den = torch.einsum('nm,bmk->bnk', maskf, ek)
        nonempty = mask.any(dim=1)[None, :, None]
        if bool(((den < torch.finfo(den.dtype).eps ** 2) & nonempty).any()):
            logits = k.unsqueeze(1).masked_fill(~mask[None, :, :, None], float('-inf'))  # [b, n, m, k]
            shift = logits.amax(dim=2, keepdim=True).detach()
            e = (logits - torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))).exp()
            den = e.sum(dim=2, keepdim=True)
            weights = e / torch.where(den > 0, den, torch.ones_like(den))  # empty context: 0, finite grads
            return torch.einsum('bnmk,bmv->bnkv', weights, v)
        return num / torch.where(den > 0, den, torch.ones_like(den)).unsqueeze(-1)  # empty context: 0

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f'x must have shape [B, N, {self.dim}], got {tuple(x.shape)}')
        B, N, _ = x.shape
        if N > self.max_len:
            raise ValueError(f'sequence length {N} exceeds max_len={self.max_len}')
        use_cumsum = mask is None and self.causal
        if mask is None:
            mask = self._default_mask(N, x.device)
        elif mask.shape != (N, N):
            raise ValueError(f'mask must have shape [N, N] = [{N}, {N}], got {tuple(mask.shape)}')
        mask = mask.to(torch.bool)
        # Non-finite inputs stay inside the contexts that contain them (see the module docstring).
        bad = ~torch.isfinite(x).all(dim=-1)  # [B, N]
        x = x.masked_fill(bad.unsqueeze(-1), 0)
        poisoned = (mask.unsqueeze(0) & bad.unsqueeze(1)).any(dim=-1) | bad  # [B, n]
        q = self.to_q(x).reshape(B, N, self.heads, self.dim_k)
        k = self.to_k(x)
        k = k.to(torch.promote_types(k.dtype, torch.float32))  # >= float32, keeps float64
        v = self.to_v(x)

        # content lambdas: sum_{m in C_n} w_nm k_m v_m^T with keys normalised within C_n
        vk = v.to(k.dtype)
        if self.key_norm != 'softmax':
            mu = torch.einsum('bmk,bmv->bmkv', k, vk)
            content_lambdas = mu.cumsum(1) if use_cumsum else torch.einsum('nm,bmkv->bnkv', mask.to(mu.dtype), mu)
        elif use_cumsum:
            content_lambdas = self._causal_softmax_lambdas(k, vk)
        else:
            content_lambdas = self._masked_softmax_lambdas(k, vk, mask)
        content_lambdas = content_lambdas.to(v.dtype)

        # position lambdas: e_nm = R[m - n], zero outside the mask (and the scope)
        idx = torch.arange(N, device=x.device)
        offset = idx[None, :] - idx[:, None]  # [n, m] = m - n
        keep = mask
        if self.scope is not None:
            keep = keep & (offset.abs() <= self.scope // 2)
        emb = self.rel_emb[offset + self.max_len - 1] * keep.unsqueeze(-1).to(self.rel_emb.dtype)  # [n, m, k]
        position_lambdas = torch.einsum('nmk,bmv->bnkv', emb.to(v.dtype), v)
        lambdas = content_lambdas + position_lambdas
        y = torch.einsum('bnhk,bnkv->bnhv', q, lambdas.to(q.dtype)).reshape(B, N, self.heads * self.dim_v)
        return y.masked_fill(poisoned.unsqueeze(-1), float('nan'))
