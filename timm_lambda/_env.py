"""The ``TIMM_LAMBDA_*`` environment variables: one convention, read in one place (as timm's ``layers/config.py``).

A flag takes ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``, in any case, surrounding spaces ignored;
unset or empty is its default. A choice takes its words (any case) and, where it has an on/off meaning, the flag
words (read as ``'1'``/``'0'``). Anything else raises a ValueError that names the variable and its values:
``import timm_lambda`` checks every variable of :data:`VARIABLES` (:func:`check`), so a typo fails at load, not
18 frames deep at a first forward. Two stdlib-only copies of the parser keep the convention where this package
cannot be imported: ``timm_lambda_autoload.py`` (run from a ``.pth`` file at start-up) and
``timm_lambda_mmdet/mmcv_cuda.py`` (run as a script by ``tools/install.sh``); tests/test_env.py keeps them equal.
"""
import os
from typing import Optional, Sequence

__all__ = ['TRUE', 'FALSE', 'VARIABLES', 'RETIRED', 'env_flag', 'env_choice', 'parse_flag', 'parse_choice', 'check']

TRUE = ('1', 'true', 'yes', 'on')
FALSE = ('0', 'false', 'no', 'off')

# name: (kind, default, choices, what it does). 'flag', 'choice' (its choices plus the flag words as '1'/'0') or
# 'name' (its choices only).
VARIABLES = {
    'TIMM_LAMBDA_BACKEND': ('name', 'auto', ('auto', 'cpu_kernel', 'triton_tc', 'triton_fma', 'gemm', 'plain'),
                            'the backend of the position lambdas (layers/position_lambda/backends.py)'),
    'TIMM_LAMBDA_NO_AUTOLOAD': ('flag', False, (), 'skip registering the models at `import timm` (the .pth hook)'),
    'TIMM_LAMBDA_STRICT': ('flag', False, (), 'a position-lambda backend that fails raises (no next backend)'),
    'TIMM_LAMBDA_MMCV_CUDA': ('choice', 'auto', ('auto',), 'tools/install.sh: mmcv with CUDA ops: auto, on or off'),
}


# variables this package no longer reads: set, they fail the import with their successor named (not ignored)
RETIRED = {
    'TIMM_LAMBDA_CPU_KERNEL': 'TIMM_LAMBDA_BACKEND (gemm runs the tiled form without the CPU kernel)',
    'TIMM_LAMBDA_TRITON': 'TIMM_LAMBDA_BACKEND (triton_tc, triton_fma or gemm on CUDA; auto picks)',
}


def _values(choices: Sequence[str]) -> str:
    words = ', '.join(choices) + ', ' if choices else ''
    return f"{words}1/true/yes/on or 0/false/no/off (any case)"


def parse_flag(name: str, value: Optional[str], default: bool) -> bool:
    """``value`` of the flag ``name`` (None or empty: ``default``): a choice with no words of its own."""
    return parse_choice(name, value, (), '1' if default else '0') == '1'


def parse_choice(name: str, value: Optional[str], choices: Sequence[str], default: str, flags: bool = True) -> str:
    """``value`` of the choice ``name``: one of ``choices`` (lower case), ``'1'``/``'0'`` for a flag word (unless
    ``flags`` is False), or ``default`` where None or empty."""
    word = (value or '').strip().lower()
    if not word:
        return default
    if word in choices:
        return word
    if flags and word in TRUE:
        return '1'
    if flags and word in FALSE:
        return '0'
    values = _values(choices) if flags else ', '.join(choices)
    raise ValueError(f'{name}={value!r} is not a valid value: use {values}, or leave it unset')


def env_flag(name: str, default: bool) -> bool:
    """The flag ``$name``: True for 1/true/yes/on, False for 0/false/no/off (any case), ``default`` if unset."""
    return parse_flag(name, os.environ.get(name), default)


def env_choice(name: str, choices: Sequence[str], default: str, flags: bool = True) -> str:
    """The choice ``$name``: one of ``choices``, ``'1'``/``'0'`` for a flag word (``flags``), ``default`` if unset."""
    return parse_choice(name, os.environ.get(name), choices, default, flags)


def check() -> None:
    """Read every variable of :data:`VARIABLES`: a ValueError names the first invalid one and its values, or a
    retired one (:data:`RETIRED`) and its successor."""
    for name, successor in RETIRED.items():
        if os.environ.get(name):
            raise ValueError(f'{name} is no longer read: unset it and use {successor}; '
                             'docs/install.md, "Environment variables"')
    for name, (kind, default, choices, _) in VARIABLES.items():
        if kind == 'flag':
            env_flag(name, default)
        else:
            env_choice(name, choices, default, flags=kind == 'choice')
