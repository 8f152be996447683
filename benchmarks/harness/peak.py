"""The CPU's float32 multiply-add limit, measured: the yardstick for the GMAC/s of ``benchmarks/benchmark_*.py``.

A register-only loop (twelve independent vector accumulators per thread, ``-O3 -march=native``, GCC/Clang vector
extensions: whatever the machine's widest FMA is) on every thread torch uses (OpenMP); no memory traffic, so it is the
most multiply-adds per second that any kernel, oneDNN's convolution included, can reach on these threads. Plain C
loaded by ctypes, built with the machine's C compiler on first use (under a second: no torch headers) into
``~/.cache/timm-lambda/peak/``; None where that fails.
"""
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from typing import Optional

import torch

__all__ = ['fma_peak_gmacs']

_SOURCE = r'''
typedef float vec16 __attribute__((vector_size(64)));
/* acc = acc * x + y on twelve independent accumulators, iters times, on each of threads threads; returns a sum
   (kept live) */
double fma_loop(long long iters, int threads) {
  double s = 0;
  #pragma omp parallel for num_threads(threads) reduction(+:s)
  for (int t = 0; t < threads; ++t) {
    vec16 a[12];
    for (int i = 0; i < 12; ++i) a[i] = (vec16){} + (float)(i + t);
    const vec16 x = (vec16){} + 0.999999f, y = (vec16){} + 1e-6f;
    for (long long k = 0; k < iters; ++k)
      for (int i = 0; i < 12; ++i) a[i] = a[i] * x + y;
    for (int i = 0; i < 12; ++i) s += a[i][0];
  }
  return s;
}
'''
_FLAGS = ['-O3', '-march=native', '-ffp-contract=fast', '-fopenmp', '-shared', '-fPIC']


@functools.lru_cache(maxsize=None)
def _library():
    compiler = shutil.which(os.environ.get('CC', 'cc')) or shutil.which('gcc')
    if compiler is None:
        return None
    tag = hashlib.sha1((_SOURCE + ' '.join(_FLAGS) + compiler).encode()).hexdigest()[:12]
    folder = os.path.join(os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'timm-lambda', 'peak')
    path = os.path.join(folder, f'fma_peak_{tag}.so')
    try:
        if not os.path.exists(path):
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                src, out = os.path.join(tmp, 'peak.c'), os.path.join(tmp, 'peak.so')
                with open(src, 'w') as f:
                    f.write(_SOURCE)
                subprocess.run([compiler, *_FLAGS, src, '-o', out], check=True, capture_output=True)
                os.replace(out, path)  # atomic: a concurrent build loads one whole library or the other
        lib = ctypes.CDLL(path)
    except (OSError, subprocess.CalledProcessError):  # no working compiler or OpenMP: no yardstick
        return None
    lib.fma_loop.argtypes, lib.fma_loop.restype = [ctypes.c_longlong, ctypes.c_int], ctypes.c_double
    return lib


def fma_peak_gmacs(seconds: float = 0.3, rounds: int = 5) -> Optional[float]:
    """Float32 multiply-adds per second (G) on ``torch.get_num_threads()`` threads: the best of ``rounds`` runs of
    about ``seconds`` each."""
    lib = _library()
    if lib is None:
        return None
    threads, per_iter = torch.get_num_threads(), 12 * 16
    iters = 1 << 16
    lib.fma_loop(iters, threads)
    t = time.perf_counter()
    lib.fma_loop(iters, threads)
    iters = max(iters, int(iters * seconds / max(time.perf_counter() - t, 1e-6)))
    best = float('inf')
    for _ in range(rounds):
        t = time.perf_counter()
        lib.fma_loop(iters, threads)
        best = min(best, time.perf_counter() - t)
    return threads * iters * per_iter / best / 1e9
