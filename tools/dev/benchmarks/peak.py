"""The CPU's float32 multiply-add limit, measured: the yardstick for the GMAC/s of ``tools/benchmark_*.py``.

A register-only loop (twelve independent vector accumulators per thread, ``-O3 -march=native``, GCC/Clang vector
extensions: whatever the machine's widest FMA is) on every thread torch uses; no memory traffic, so it is the most
multiply-adds per second that any kernel, oneDNN's convolution included, can reach on these threads. Built with the
machine's C++ compiler on first use (like the tiled form's CPU kernel); None where that fails.
"""
import functools
import time
from typing import Optional

import torch

__all__ = ['fma_peak_gmacs']

_SOURCE = r'''
#include <torch/extension.h>
#include <ATen/Parallel.h>
typedef float vec16 __attribute__((vector_size(64)));
// acc = acc * x + y on twelve independent accumulators, iters times, on every thread; returns a sum (kept live)
double fma_loop(int64_t iters) {
  const int64_t n = at::get_num_threads();
  std::vector<double> out(n, 0.0);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      vec16 a[12];
      for (int i = 0; i < 12; ++i) a[i] = vec16{} + (float)(i + t);
      const vec16 x = vec16{} + 0.999999f, y = vec16{} + 1e-6f;
      for (int64_t k = 0; k < iters; ++k)
        for (int i = 0; i < 12; ++i) a[i] = a[i] * x + y;
      for (int i = 0; i < 12; ++i) out[t] += a[i][0];
    }
  });
  double s = 0;
  for (double v : out) s += v;
  return s;
}
'''


@functools.lru_cache(maxsize=None)
def _module():
    from torch.utils import cpp_extension
    try:
        return cpp_extension.load_inline('timm_lambda_fma_peak', cpp_sources=_SOURCE, functions=['fma_loop'],
                                         extra_cflags=['-O3', '-march=native', '-ffp-contract=fast', '-fopenmp'],
                                         extra_ldflags=['-fopenmp'])
    except Exception:  # no compiler: no yardstick
        return None


def fma_peak_gmacs(seconds: float = 0.3, rounds: int = 5) -> Optional[float]:
    """Float32 multiply-adds per second (G) on ``torch.get_num_threads()`` threads: the best of ``rounds`` runs of
    about ``seconds`` each."""
    module = _module()
    if module is None:
        return None
    threads, per_iter = torch.get_num_threads(), 12 * 16
    iters = 1 << 16
    module.fma_loop(iters)
    t = time.perf_counter()
    module.fma_loop(iters)
    iters = max(iters, int(iters * seconds / max(time.perf_counter() - t, 1e-6)))
    best = float('inf')
    for _ in range(rounds):
        t = time.perf_counter()
        module.fma_loop(iters)
        best = min(best, time.perf_counter() - t)
    return threads * iters * per_iter / best / 1e9
