"""Measuring speed and memory on a shared machine: the helpers behind ``tools/benchmark_*.py``.

* Times are taken **side by side in one process, interleaved** (A, B, A, B, ... with the order reversed
  every other round) and summarised by the median, so a load change hits every candidate alike; report
  ratios, and the machine's load (:func:`machine`) with every figure.
* Peak memory of a step is measured once, in a separate untimed run. On CUDA it is
  ``torch.cuda.max_memory_allocated`` above what was allocated before the step. On the CPU it is the
  largest sum of bytes of tensor storages created during the step and alive at the same time
  (:class:`LiveTensorBytes`, a ``TorchDispatchMode`` that sees every aten op, forward and backward):
  activations saved for the backward, temporaries, gradients. Parameters and inputs, which exist before
  the step, are not counted; buffers a kernel allocates internally (e.g. a convolution's im2col scratch)
  are not visible to it. Memory figures are deterministic, times are not.
"""
import os
import platform
import statistics
import time
import weakref
from typing import Callable, Dict, Iterable, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ['LiveTensorBytes', 'peak_step_bytes', 'interleaved_times', 'median', 'machine', 'load_average',
           'synchronize', 'spread']


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (``uptime``), or '?' where the OS does not say."""
    try:
        return ' '.join(f'{x:.2f}' for x in os.getloadavg())
    except OSError:
        return '?'


def machine(device: str = 'cpu') -> str:
    """One line naming the device, threads, torch version and the load when called."""
    if device.startswith('cuda'):
        what = torch.cuda.get_device_name()
    else:
        what = f'{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores, ' \
               f'{torch.get_num_threads()} threads'
    return f'{what}, torch {torch.__version__}, load average {load_average()}'


def synchronize(device: str) -> None:
    if device.startswith('cuda'):
        torch.cuda.synchronize()


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created by aten ops inside the mode and alive at the same time.

    ``exclude``: tensors (parameters, inputs) whose storages are never counted.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.live = {}  # storage data_ptr -> [nbytes, tensors using it]
        self.current = 0
        self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == 'meta':
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in self.exclude:
                continue
            entry = self.live.get(ptr)
            if entry is None:
                entry = self.live[ptr] = [storage.nbytes(), 0]
                self.current += entry[0]
                self.peak = max(self.peak, self.current)
            entry[1] += 1
            weakref.finalize(t, self._release, ptr)
        return out


def peak_step_bytes(step: Callable[[], object], exclude: Iterable[torch.Tensor] = (), device: str = 'cpu') -> int:
    """Peak memory one call of ``step`` adds (see the module docstring for what is counted)."""
    if device.startswith('cuda'):
        synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated() - base
    with LiveTensorBytes(exclude) as tracker:
        step()
    return tracker.peak


def interleaved_times(steps: Dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                      device: str = 'cpu', max_seconds: Optional[float] = None) -> Dict[str, List[float]]:
    """Seconds per call of each step, run in interleaved rounds (the order reversed every other round).

    ``max_seconds``: stop adding rounds once this much time has been spent (at least one round runs).
    """
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    times = {name: [] for name in steps}
    names = list(steps)
    started = time.perf_counter()
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            synchronize(device)
            t0 = time.perf_counter()
            steps[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
        if max_seconds is not None and time.perf_counter() - started > max_seconds:
            break
    return times


def median(values: List[float]) -> float:
    return statistics.median(values)


def spread(values: List[float]):
    """(min, median, max) of repeated measurements."""
    return min(values), statistics.median(values), max(values)
