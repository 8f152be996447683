"""The ``TIMM_LAMBDA_*`` environment variables: one table, one parser, read in one place (as timm's
``layers/config.py``).

A flag takes ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``, in any case, surrounding spaces ignored;
unset or empty is its default. A choice takes its words (any case) and the flag words (read as ``'1'``/``'0'``); a
name its words only (``TIMM_LAMBDA_BACKEND``: the registered backends', checked when the package has registered
them); a pattern a value that matches it. Anything else raises a ValueError that names the variable and its values:
``import timm_lambda`` checks every variable of :data:`VARIABLES` (:func:`check`), so a typo fails at load, not 18
frames deep at a first forward.

Standard library only, and loaded by its file where this package cannot be imported: by the ``.pth`` hook
``timm_lambda_autoload.py`` at ``import timm``, and by ``timm_lambda_mmdet/mmcv_cuda.py``, which ``tools/install.sh``
runs before the package is installed (each through ``importlib.util.spec_from_file_location``).
"""
import os
import re
from typing import Optional, Sequence, Union

__all__ = ['TRUE', 'FALSE', 'VARIABLES', 'RETIRED', 'env', 'env_flag', 'env_choice', 'parse_flag', 'parse_choice',
           'check']

TRUE = ('1', 'true', 'yes', 'on')
FALSE = ('0', 'false', 'no', 'off')

# name: (kind, default, choices, what it does). Kinds: 'flag'; 'choice' (its choices plus the flag words as '1'/'0');
# 'name' (its choices only; None: the registry's, checked by timm_lambda.layers.position_lambda); 'pattern' (a value
# matching the regular expression in place of the choices).
VARIABLES = {
    'TIMM_LAMBDA_BACKEND': ('name', 'auto', None, 'the backend of the position lambdas: auto or a registered '
                                                  "backend's name (layers/position_lambda/backends.py)"),
    'TIMM_LAMBDA_STRICT': ('flag', False, (), 'a position-lambda backend that fails raises (no next backend)'),
    'TIMM_LAMBDA_NO_AUTOLOAD': ('flag', False, (), 'skip registering the models at `import timm` (the .pth hook)'),
    'TIMM_LAMBDA_CPU_ARCH': ('pattern', 'native', r'[A-Za-z0-9][A-Za-z0-9.+-]*',
                             "the CPU kernel's -march= target (layers/position_lambda/cpu_kernel.py)"),
    'TIMM_LAMBDA_CPU_BF16': ('name', '', ('brgemm', 'avx512_bf16', 'float32'),
                             "the CPU kernel's bfloat16 path, forced (unset: the one measured fastest on this CPU)"),
    'TIMM_LAMBDA_MMCV_CUDA': ('choice', 'auto', ('auto',), 'tools/install.sh: mmcv with CUDA ops: auto, on or off'),
    # the test suite's: a missing part fails its tests instead of skipping them (.ci/run sets them)
    'TIMM_LAMBDA_REQUIRE_DET': ('flag', False, (), 'tests: MMDetection must be installed'),
    'TIMM_LAMBDA_REQUIRE_TIMM_SUITE': ('flag', False, (), "tests: timm's own model tests must run"),
    'TIMM_LAMBDA_REQUIRE_CPU_KERNEL': ('flag', False, (), 'tests: the CPU kernel must be built'),
    'TIMM_LAMBDA_REQUIRE_TRITON': ('flag', False, (), "tests: Triton's interpreted kernel tests must run"),
    'TIMM_LAMBDA_REQUIRE_PAPERS': ('flag', False, (), 'tests: the paper texts must be found (also CI=true)'),
    'TIMM_LAMBDA_TIMM_SUITE_ALL': ('flag', False, (), "tests: timm's model suite on every model, not representatives"),
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


def parse_pattern(name: str, value: Optional[str], pattern: str, default: str) -> str:
    """``value`` of ``name`` where it matches ``pattern`` (surrounding spaces ignored; unset or empty: ``default``)."""
    word = (value or '').strip()
    if not word:
        return default
    if not re.fullmatch(pattern, word):
        raise ValueError(f'{name}={value!r} is not a valid value: use a value matching {pattern}, or leave it unset')
    return word


def env(name: str, choices: Optional[Sequence[str]] = None) -> Union[bool, str]:
    """The variable ``name`` of :data:`VARIABLES`, read by its kind: a flag as a bool, a choice, name or pattern as a
    string (``choices``: a name's words where the table leaves them to the caller)."""
    kind, default, table_choices, _ = VARIABLES[name]
    value = os.environ.get(name)
    if kind == 'flag':
        return parse_flag(name, value, default)
    if kind == 'pattern':
        return parse_pattern(name, value, table_choices, default)
    return parse_choice(name, value, table_choices if choices is None else choices, default, flags=kind == 'choice')


def env_flag(name: str, default: bool) -> bool:
    """The flag ``$name``: True for 1/true/yes/on, False for 0/false/no/off (any case), ``default`` if unset."""
    return parse_flag(name, os.environ.get(name), default)


def env_choice(name: str, choices: Sequence[str], default: str, flags: bool = True) -> str:
    """The choice ``$name``: one of ``choices``, ``'1'``/``'0'`` for a flag word (``flags``), ``default`` if unset."""
    return parse_choice(name, os.environ.get(name), choices, default, flags)


def check() -> None:
    """Read every variable of :data:`VARIABLES` (a name without its words: when they are known): a ValueError names
    the first invalid one and its values, or a retired one (:data:`RETIRED`) and its successor."""
    for name, successor in RETIRED.items():
        if os.environ.get(name):
            raise ValueError(f'{name} is no longer read: unset it and use {successor}; '
                             'docs/install.md, "Environment variables"')
    for name, (kind, _, choices, _) in VARIABLES.items():
        if not (kind == 'name' and choices is None):
            env(name)

