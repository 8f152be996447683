"""Masked multi-query lambda layer for 1-D sequences (LambdaNetworks appendix C.2, Fig. 6).

Query ``n`` only sees its sub-context ``C_n = {m : mask[n, m]}`` (causal by default: ``m <= n``)::

    lambda_n = sum_{m in C_n} (softmax_{m in C_n}(k)_m + e_nm) v_m^T ,   y_n = concat_h(lambda_n^T q_n^h)

Keys are normalised over each query's own context only ("Keys should be normalized by only
considering the elements in their contexts", Fig. 6). The mask is shared over the batch, so no
per-example ``n x m`` map is built: contributions ``k_m v_m^T`` are summed with prefix
log-sum-exps (causal: exact for any key magnitude) or a mask contraction (general mask).

Choice: no batch norm on queries and values here (unlike the 2-D layer). Batch statistics over
the sequence would let future positions influence the present in training mode.

Non-finite values: a position whose input holds a NaN or Inf, or whose key, value (or, without key
normalisation, key-value product) overflows, is zeroed (selected out, never multiplied by a 0 mask, so
neither ``0 x inf`` nor an overflowing gradient can reach queries that do not see it) and every query
whose context contains it outputs NaN; so does a query whose own input or query overflows, or whose
lambda overflows. The outputs at ``n`` and their gradients depend only on inputs in ``C_n`` and on
``x_n`` for any input values.
"""
from typing import Optional

import torch
from torch import nn

from .checks import check_bool, check_choice, to_int

__all__ = ['MaskedLambdaLayer1d']


def _zero_nonfinite(t: torch.Tensor, lead: int = 2):
    """``t`` with every position (its first ``lead`` dims) that holds a non-finite entry set to 0, and the
    bool map of those positions. A selection (masked_fill), so no ``0 x inf`` reaches the backward."""
    bad = ~torch.isfinite(t).flatten(lead).all(-1)
    return t.masked_fill(bad.reshape(bad.shape + (1,) * (t.dim() - lead)), 0), bad


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
        # per-position products first (|ek| <= 1, finite), then a constant-mask contraction: the backward
        # never forms (masked query) x (value) products
        num = torch.einsum('nm,bmkv->bnkv', maskf, ek.unsqueeze(-1) * v.unsqueeze(-2))
        den = torch.einsum('nm,bmk->bnk', maskf, ek)
        nonempty = mask.any(dim=1)[None, :, None]
        if bool(((den < torch.finfo(den.dtype).eps ** 2) & nonempty).any()):
            logits = k.unsqueeze(1).masked_fill(~mask[None, :, :, None], float('-inf'))  # [b, n, m, k]
            shift = logits.amax(dim=2, keepdim=True).detach()
            e = (logits - torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))).exp()
            den = e.sum(dim=2, keepdim=True)
            weights = e / torch.where(den > 0, den, torch.ones_like(den))  # empty context: 0, finite grads
            weights = weights.masked_fill(~mask[None, :, :, None], 0)  # drops the masked pairs' gradients
            return torch.einsum('bnmk,bmv->bnkv', weights, v)
        over = torch.isinf(num)  # an overflowing sum: inf, with a finite division backward
        num = num.masked_fill(over, 0)
        out = num / torch.where(den > 0, den, torch.ones_like(den)).unsqueeze(-1)  # empty context: 0
        return out.masked_fill(over, float('inf'))

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
        # Non-finite or overflowing positions stay inside the contexts that contain them (module docstring).
        x, bad = _zero_nonfinite(x)  # [B, N]
        q, bad_q = _zero_nonfinite(self.to_q(x).reshape(B, N, self.heads, self.dim_k))
        k = self.to_k(x)
        k = k.to(torch.promote_types(k.dtype, torch.float32))  # >= float32, keeps float64
        v = self.to_v(x)
        kv_bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))
        k, v = k.masked_fill(kv_bad.unsqueeze(-1), 0), v.masked_fill(kv_bad.unsqueeze(-1), 0)
        vk = v.to(k.dtype)
        if self.key_norm != 'softmax':
            mu, mu_bad = _zero_nonfinite(torch.einsum('bmk,bmv->bmkv', k, vk))  # k_m v_m^T may overflow
            kv_bad = kv_bad | mu_bad
        bad = bad | kv_bad
        poisoned = (mask.unsqueeze(0) & bad.unsqueeze(1)).any(dim=-1) | bad | bad_q  # [B, n]

        # content lambdas: sum_{m in C_n} w_nm k_m v_m^T with keys normalised within C_n
        if self.key_norm != 'softmax':
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
        # selected, not multiplied by the mask: a masked pair's (possibly overflowing) gradient is dropped
        emb = self.rel_emb[offset + self.max_len - 1].masked_fill(~keep.unsqueeze(-1), 0)  # [n, m, k]
        position_lambdas = torch.einsum('nmk,bmv->bnkv', emb.to(v.dtype), v)
        # a lambda that overflows poisons its own query only (it sums that query's context)
        lambdas, bad_lambda = _zero_nonfinite((content_lambdas + position_lambdas).to(q.dtype))
        y = torch.einsum('bnhk,bnkv->bnhv', q, lambdas).reshape(B, N, self.heads * self.dim_v)
        return y.masked_fill((poisoned | bad_lambda).unsqueeze(-1), float('nan'))
