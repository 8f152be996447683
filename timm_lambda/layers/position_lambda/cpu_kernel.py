"""The tiled form's exact CPU kernels (``tiled_cpu.h``; ``tiled_cpu.cpp``: float32 and float64; ``tiled_cpu_bf16.cpp``:
bfloat16): built with the machine's C++ compiler on first use.

Each query meets exactly its ``K_h x K_w`` scope (the GEMM path pads it to its block's window, 1.7x the work at a
23x23 scope) and its logits never leave the cache, so the layer runs near the CPU's multiply-add rate
(docs/benchmarks.md). float32 and float64 on a CPU. bfloat16 (CPU autocast) on a CPU with AVX-512 BF16 runs in
bfloat16 itself, at both strides, as a bfloat16 matmul computes: the logits rounded to bfloat16, products of bfloat16
operands summed in float32 by VDPBF16PS (``tiled_forward_bf16``, ``tiled_backward_bf16``). Other 16-bit calls run in
float32, the result rounded back. The ``cpu_kernel`` backend of :mod:`.backends`, which says where ``'auto'`` runs it
(not for 16-bit stride-2 calls without AVX-512 BF16, where the gemm backend's 16-bit GEMM is faster, nor where the
build failed: a one-time warning says why).
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

from .execution import BackendUnusable, warn_once

__all__ = ['forward', 'backward', 'unavailable', 'native', 'compute_dtype']

_logger = logging.getLogger(__name__)

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
_OFF = 'TIMM_LAMBDA_BACKEND=gemm skips the build'


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


def unavailable() -> Optional[str]:
    """Why the kernel cannot serve calls here (None: built and loaded; the first call builds it)."""
    if _build() is None:
        return 'could not be built here (the warning above says why)'
    return None


def native(dtype: torch.dtype) -> bool:
    """Whether the kernel computes a ``dtype`` call in that dtype itself: bfloat16 where the compiler targets AVX-512
    BF16 (``tiled_forward_bf16``, ``tiled_backward_bf16``); other 16-bit calls run in float32."""
    kernel = _build()
    return dtype == torch.bfloat16 and kernel is not None and kernel.bf16


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernel computes a ``dtype`` input in: itself for float32, float64 and :func:`native` bfloat16,
    else float32."""
    return dtype if dtype in (torch.float32, torch.float64) or native(dtype) else torch.float32


def _module():
    kernel = _build()
    if kernel is None:
        raise BackendUnusable('the tiled form\'s CPU kernel could not be built')
    return kernel


def _to(x: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if x is None else x.to(dtype)


def forward(q: torch.Tensor, v: torch.Tensor, table: torch.Tensor, step: int,
            content: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The tiled operator's output (layouts: :mod:`.custom_ops`) in :func:`compute_dtype`, returned in ``q``'s dtype."""
    kernel, c = _module(), compute_dtype(q.dtype)
    if c == torch.bfloat16:
        return kernel.tiled_forward_bf16(q, v, table, content, step)
    return kernel.tiled_forward(q.to(c), v.to(c), table.to(c), _to(content, c), step).to(q.dtype)


def backward(gy: torch.Tensor, q: torch.Tensor, v: torch.Tensor, table: torch.Tensor, step: int,
             content: Optional[torch.Tensor] = None):
    """The gradients of q, v, the table and the content lambda (an empty tensor without one) in the inputs' dtypes
    (a bfloat16 call's computed from its bfloat16 operands, summed in float32)."""
    kernel, c = _module(), compute_dtype(q.dtype)
    if c == torch.bfloat16:
        gq, gv, gtable, gcontent = kernel.tiled_backward_bf16(gy.to(c), q, v, table, content, step)
    else:
        gq, gv, gtable, gcontent = kernel.tiled_backward(gy.to(c), q.to(c), v.to(c), table.to(c), _to(content, c),
                                                         step)
    return (gq.to(q.dtype), gv.to(v.dtype), gtable.to(table.dtype),
            gcontent.to(v.dtype if content is None else content.dtype))
