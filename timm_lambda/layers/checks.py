"""Argument checks shared by the layers and models of this package: each check written once.

Every check raises a ``ValueError`` naming the parameter and the accepted values: bad input never fails deep in torch.
"""
import operator
from typing import Optional, Sequence, Tuple, Union

import torch
from timm.layers import to_2tuple

__all__ = ['to_int', 'to_pair', 'check_scope', 'check_choice', 'check_bool', 'check_stride', 'check_heads',
           'check_ratio', 'check_input', 'check_max_size']

Size2 = Tuple[int, int]


def to_int(value, name: str, low: int = 1) -> int:
    """``value`` as a Python int >= ``low``: ints and numpy integers pass; bools, floats and others raise."""
    if isinstance(value, bool):
        raise ValueError(f'{name} must be an int >= {low}, got the bool {value!r}')
    try:
        out = operator.index(value)  # int, numpy integer, 0-d integer tensor; not float
    except TypeError:
        raise ValueError(f'{name} must be an int >= {low}, got {value!r} ({type(value).__name__})') from None
    if out < low:
        raise ValueError(f'{name} must be an int >= {low}, got {out}')
    return out


def to_pair(value, name: str, low: int = 1) -> Size2:
    """An int (for both axes) or an (H, W) pair of ints, each >= ``low``."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f'{name} must be an int or an (H, W) pair, got {value!r}')
        return to_int(value[0], f'{name}[0]', low), to_int(value[1], f'{name}[1]', low)
    return to_2tuple(to_int(value, name, low))


def check_scope(scope) -> Union[str, Size2]:
    """A position scope: an odd int >= 1 (or an (h, w) pair of them), or 'global'."""
    if isinstance(scope, str) and scope == 'global':
        return 'global'
    pair = None if scope is None or isinstance(scope, str) else to_pair(scope, 'scope')
    if pair is None or any(s % 2 == 0 for s in pair):
        raise ValueError(f"scope must be an odd int >= 1 (e.g. 23 for 23x23), an (h, w) pair of them, or 'global' "
                         f"(with max_size or img_size), got {scope!r}")
    return pair


def check_choice(value, name: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f'{name} must be one of {tuple(choices)}, got {value!r}')
    return value


def check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f'{name} must be True or False, got {value!r}')
    return value


def check_stride(stride) -> int:
    """1, or 2 for a downsampling layer (3x3 average pooling after it, appendix F.2)."""
    stride = to_int(stride, 'stride')
    if stride not in (1, 2):
        raise ValueError(f'stride must be 1 or 2, got {stride}')
    return stride


def check_heads(heads, dim_out: int, name: str = 'heads') -> int:
    """A number of heads >= 1 that divides the output width (each head gets ``dim_out / heads`` channels)."""
    heads = to_int(heads, name)
    if dim_out % heads:
        raise ValueError(f'{name}={heads} must divide the output width dim_out={dim_out}')
    return heads


def check_ratio(value, name: str, low: float = 0.0, high: float = float('inf'), high_inclusive: bool = True) -> float:
    """A real number in ``(low, high]`` (or ``(low, high)``), bools refused."""
    ok = not isinstance(value, bool)
    try:
        value = float(value)
    except (TypeError, ValueError):
        ok = False
    if not (ok and low < value and (value <= high if high_inclusive else value < high)):
        raise ValueError(f'{name} must be a number in ({low}, {high}{"]" if high_inclusive else ")"}, got {value!r}')
    return value


def check_input(x: torch.Tensor, channels: int, name: str, mode: Optional[str] = None) -> None:
    """Raise a ValueError unless ``x`` is ``[B, channels, H, W]`` (an FX leaf where the layers use it: checked
    at run time; a trace skips it, its weights fix the channels). ``mode``: the call's execution mode where the caller
    has read it (:func:`.execution.mode`; ``'trace'`` skips), else ``torch.jit.is_tracing()`` is asked."""
    if (mode == 'trace') if mode is not None else torch.jit.is_tracing():
        return
    if x.dim() != 4 or x.shape[1] != channels:
        raise ValueError(f'{name} expects x of shape [B, {channels}, H, W], got {list(x.shape)}')
    if x.shape[2] < 1 or x.shape[3] < 1:
        raise ValueError(f'{name} needs an input of at least 1x1 (H, W >= 1), got {x.shape[2]}x{x.shape[3]}')


def check_max_size(height: int, width: int, max_h: int, max_w: int) -> None:
    """The input a global position table covers: at most ``max_size`` (its construction size)."""
    if height > max_h or width > max_w:
        raise ValueError(f'input of {height}x{width} is larger than max_size=({max_h}, {max_w}) of the global '
                         f'position embedding; build the layer with a larger max_size (img_size) or use a local scope')
