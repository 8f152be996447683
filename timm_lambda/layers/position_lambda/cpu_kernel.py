"""The tiled form's exact CPU kernels (``tiled_cpu.h``; ``tiled_cpu.cpp``: float32 and float64; ``tiled_cpu_bf16.cpp``:
bfloat16): built with the machine's C++ compiler on first use.

Each query meets exactly its ``K_h x K_w`` scope (the GEMM path pads it to its block's window, 1.7x the work at a
23x23 scope) and its logits never leave the cache, so the layer runs near the CPU's multiply-add rate
(docs/benchmarks.md). float32 and float64 on a CPU. bfloat16 (CPU autocast) on a CPU with AVX-512 BF16 runs in
bfloat16 itself, at both strides, as a bfloat16 matmul computes: the logits rounded to bfloat16, products of bfloat16
operands summed in float32 by VDPBF16PS (``tiled_forward_bf16``, ``tiled_backward_bf16``). Other 16-bit calls run at
stride 1 in float32, the result rounded back; at stride 2 the GEMM path's big GEMM (9 |k| deep) runs faster in
bfloat16 than the kernel in float32 (both measured in docs/benchmarks.md), so those calls, other devices, or a machine
where the build fails (a one-time warning says why) run the GEMM path of :mod:`.custom_ops`.
``TIMM_LAMBDA_CPU_KERNEL=0`` (or false/no/off) turns it off.
"""
import errno
import functools
import hashlib
import logging
import os
import platform
import shutil
from typing import Optional

import torch

from ..._env import env_flag
from .execution import warn_once

__all__ = ['cpu_kernel', 'compute_dtype', 'native_bfloat16']

_logger = logging.getLogger(__name__)

ENABLED = env_flag('TIMM_LAMBDA_CPU_KERNEL', True)
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_HERE, name) for name in ('tiled_cpu.cpp', 'tiled_cpu_bf16.cpp')]
_HEADER = os.path.join(_HERE, 'tiled_cpu.h')


def _machine_tag() -> str:
    """A build name per CPU, torch and header (``-march=native`` code must not load on another CPU sharing the cache;
    torch itself rebuilds when a source file or the flags change, not for another CPU or torch, nor for a header)."""
    flags = ''
    if os.path.exists('/proc/cpuinfo'):
        with open('/proc/cpuinfo') as f:
            flags = next((line for line in f if line.startswith(('flags', 'Features'))), '')
    with open(_HEADER) as f:
        header = f.read()
    return hashlib.sha1(f'{platform.machine()} {flags} {torch.__version__} {header}'.encode()).hexdigest()[:12]


_FALLBACK = 'the position lambdas run as batched GEMMs instead (correct, about half as fast)'
_OFF = 'TIMM_LAMBDA_CPU_KERNEL=0 skips the build'


def _build_failed(e: Exception, build_dir: Optional[str]) -> str:
    """The warning for a failed build: the cause and its remedy on the first line, torch's output (its banner and
    the compiler's messages, kilobytes) after it."""
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        where = build_dir or getattr(e, 'filename', None) or "torch's extension cache"
        first = (f'the tiled form\'s CPU kernel could not be built: its build folder {where} is not writable; set '
                 f'TORCH_EXTENSIONS_DIR to a writable folder ({_OFF}); {_FALLBACK}')
    else:
        first = (f'the tiled form\'s CPU kernel could not be built ({type(e).__name__}): install a C++ compiler with '
                 f'OpenMP (g++, or clang++ with libomp) or see its output below ({_OFF}); {_FALLBACK}')
    return f'{first}\n{str(e)[-3000:]}\n'


def _build_dir(name: str) -> Optional[str]:
    """torch's build folder for extension ``name`` (``$TORCH_EXTENSIONS_DIR/name`` or torch's default; private API,
    ``torch.utils.cpp_extension._get_build_directory``, which also creates it), or None where that fails."""
    from torch.utils import cpp_extension
    try:
        return cpp_extension._get_build_directory(name, False)
    except Exception:
        return None


@functools.lru_cache(maxsize=None)
def _build():
    from torch.utils import cpp_extension
    try:
        import ninja  # the pip package (a dependency): torch runs `ninja`, on PATH only in an active venv
        if shutil.which('ninja') is None:
            os.environ['PATH'] = ninja.BIN_DIR + os.pathsep + os.environ.get('PATH', '')
    except ImportError:
        pass
    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:  # torch would print its ABI banner, then fail kilobytes later
        warn_once('cpu_kernel', f'the tiled form\'s CPU kernel was not built: no C++ compiler ({compiler!r}, '
                                f'$CXX or c++ on PATH); install one with OpenMP, e.g. g++ ({_OFF}); {_FALLBACK}')
        return None
    name = f'timm_lambda_tiled_cpu_{_machine_tag()}'
    build_dir = _build_dir(name)
    if build_dir is None or not os.path.exists(os.path.join(build_dir, name + '.so')):
        _logger.warning('timm_lambda: building the tiled form\'s CPU kernel, once per CPU and torch version (about '
                        '40 s on 2 cores), into %s; %s', build_dir or "torch's extension cache", _OFF)
    try:
        return cpp_extension.load(name, _SOURCES, extra_cflags=['-O3', '-march=native', '-fopenmp'],
                                  extra_ldflags=['-fopenmp'])
    except Exception as e:  # no ninja, no OpenMP, a read-only cache: the GEMM path
        warn_once('cpu_kernel', _build_failed(e, build_dir))
        return None


_SERVED = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@torch.jit.unused
def cpu_kernel(x: torch.Tensor, step: int = 1) -> Optional[object]:
    """The built kernel module when it serves ``x`` at ``step`` (a CPU tensor in a dtype of ``_SERVED``; a 16-bit
    one at step 1, computed in :func:`compute_dtype`, or a bfloat16 one at any step where
    :func:`native_bfloat16`), else None."""
    if not ENABLED or x.device.type != 'cpu' or x.dtype not in _SERVED:
        return None
    kernel = _build()
    if step != 1 and compute_dtype(x.dtype) != x.dtype and not native_bfloat16(kernel, x.dtype):
        return None
    return kernel


def native_bfloat16(kernel, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` computes a ``dtype`` call in bfloat16 itself (``tiled_forward_bf16`` and
    ``tiled_backward_bf16``: built where the compiler targets AVX-512 BF16), instead of in float32."""
    return dtype == torch.bfloat16 and kernel is not None and kernel.bf16


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernel computes a ``dtype`` input in: float32 and float64 as they are, the 16-bit ones in
    float32."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32
