"""Translation-equivariant relative position embeddings (LambdaNetworks, section 3.3).

One table ``R`` indexed by the relative offset ``m - n`` between a context position ``m``
and a query position ``n`` holds every embedding: ``e_nm = R[m - n]`` (section 3.3,
footnote 8). Because only offsets are stored, the same parameters serve every input size.

* local scope ``r x r`` (section 3.4): the table covers offsets ``[-(r//2), r//2]`` in each
  axis; embeddings of context positions outside the scope are zero ("masked").
* global scope: the table covers every offset of the largest feature map given at
  construction, ``[-(H_max - 1), H_max - 1] x [-(W_max - 1), W_max - 1]``.

The table is stored as ``[|k|, |u|, R_h, R_w]`` so that it is directly the kernel of the lambda
convolution (appendix C.1, "(n+1)-d convolution" with the value depth as the extra axis).
"""
from typing import Tuple, Union

import torch
from torch import nn
import torch.nn.functional as F

__all__ = ['RelativePositionEmbedding', 'check_scope']

Size2 = Tuple[int, int]


def _pair(value, name: str) -> Size2:
    if isinstance(value, int):
        value = (value, value)
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise ValueError(f'{name} must be an int or a pair of ints, got {value!r}')
    return tuple(value)


def check_scope(scope) -> Union[str, Size2]:
    """Validate a scope argument: an odd int >= 1 (or an (h, w) pair of them), or 'global'."""
    if scope == 'global' or scope is None:
        return 'global'
    scope = _pair(scope, 'scope')
    if any(s < 1 or s % 2 == 0 for s in scope):
        raise ValueError(f"scope must be odd and >= 1 (e.g. 23 for 23x23) or 'global', got {scope!r}")
    return scope


class RelativePositionEmbedding(nn.Module):
    """Relative position embedding table ``R`` shared by every query position.

    Args:
        dim_k: query/key depth |k|.
        dim_u: intra-depth |u| (appendix C.4).
        scope: odd local scope size (int or (h, w)), or 'global'.
        max_size: (H_max, W_max), required for a global scope: the largest feature map the
            table must cover. A larger input raises a ValueError.

    The module can be passed to several lambda layers to share embeddings (Table 4).
    """

    def __init__(self, dim_k: int = 16, dim_u: int = 1, scope=23, max_size=None):
        super().__init__()
        if not isinstance(dim_k, int) or dim_k < 1:
            raise ValueError(f'dim_k must be an int >= 1, got {dim_k!r}')
        if not isinstance(dim_u, int) or dim_u < 1:
            raise ValueError(f'dim_u must be an int >= 1, got {dim_u!r}')
        self.dim_k, self.dim_u = dim_k, dim_u
        self.scope = check_scope(scope)
        if self.scope == 'global':
            if max_size is None:
                raise ValueError("max_size=(H, W) is required when scope='global': the table must "
                                 "cover every relative offset of the largest input")
            max_size = _pair(max_size, 'max_size')
            if min(max_size) < 1:
                raise ValueError(f'max_size must be >= 1, got {max_size!r}')
            self.max_size = max_size
            self.radius = (max_size[0] - 1, max_size[1] - 1)
        else:
            self.max_size = None
            self.radius = (self.scope[0] // 2, self.scope[1] // 2)
        table_size = (2 * self.radius[0] + 1, 2 * self.radius[1] + 1)
        self.weight = nn.Parameter(torch.empty(dim_k, dim_u, *table_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Appendix F.2: position embeddings ~ N(0, 1).
        nn.init.normal_(self.weight, std=1.0)

    def extra_repr(self) -> str:
        return f'dim_k={self.dim_k}, dim_u={self.dim_u}, scope={self.scope}, table={tuple(self.weight.shape[2:])}'

    def check_size(self, height: int, width: int) -> None:
        if self.max_size is not None and (height > self.max_size[0] or width > self.max_size[1]):
            raise ValueError(
                f'input of {height}x{width} is larger than max_size={self.max_size} of the global '
                f'position embedding; build the layer with a larger max_size or use a local scope')

    def kernel(self, height: int, width: int) -> torch.Tensor:
        """Lambda-convolution kernel for a ``height x width`` input: ``[k, u, 2a+1, 2b+1]``.

        Only offsets that can occur in the input are kept (``a = min(radius_h, H - 1)``), so a
        small input does not pay for a large scope; results are identical.
        """
        self.check_size(height, width)
        a, b = min(self.radius[0], height - 1), min(self.radius[1], width - 1)
        ch, cw = self.radius
        return self.weight[:, :, ch - a:ch + a + 1, cw - b:cw + b + 1]

    def dense(self, height: int, width: int) -> torch.Tensor:
        """Embeddings ``E`` gathered for every (query n, context m) pair: ``[k, u, n, m]``.

        ``E[:, :, n, m] = R[m - n]`` inside the scope and 0 outside it (Fig. 3 / Fig. 5 'einsum').
        This materialises ``|k||u||n||m|`` values: use it for small inputs only.
        """
        kern = self.kernel(height, width)
        a, b = (kern.shape[-2] - 1) // 2, (kern.shape[-1] - 1) // 2
        # zero-pad to cover every offset in [-(H-1), H-1] x [-(W-1), W-1]: the mask of section 3.4
        full = F.pad(kern, (width - 1 - b, width - 1 - b, height - 1 - a, height - 1 - a))
        dev = kern.device
        ys, xs = torch.arange(height, device=dev), torch.arange(width, device=dev)
        iy = ys[None, :] - ys[:, None] + (height - 1)  # [n_y, m_y] -> offset index
        ix = xs[None, :] - xs[:, None] + (width - 1)  # [n_x, m_x]
        emb = full[:, :, iy[:, None, :, None], ix[None, :, None, :]]  # k, u, Hn, Wn, Hm, Wm
        n = height * width
        return emb.reshape(self.dim_k, self.dim_u, n, n)
