"""Measuring speed and memory on a shared machine: the helpers behind ``benchmarks/*.py``.

* Times are taken **side by side in one process, interleaved** (A, B, A, B, ... with the order reversed
  every other round) and summarised by the median, so a load change hits every candidate alike; report
  ratios, and the machine's load (:func:`machine`) with every figure.
* Peak memory of a step is measured in a separate untimed run, after one warm-up call, as the most memory
  the step holds at once above what was allocated before it. On CUDA that is ``torch.cuda.max_memory_allocated``
  minus what was allocated before the step. On the CPU it is read from the allocator itself: the step runs
  under ``torch.profiler.profile(profile_memory=True)``, whose ``[memory]`` events record every block the CPU
  allocator hands out or takes back, inside custom operators and kernels as well (a convolution's scratch,
  the temporaries of ``timm_lambda::lambda_layer``), and the peak of their running sum is the figure
  (:func:`peak_of_memory_events`). Blocks that existed before the step (parameters, inputs, gradients kept
  from an earlier step) are not counted; memory a library takes from ``malloc`` directly, or allocates on a
  thread the profiler does not follow, is not visible.
  Memory figures are deterministic, times are not.
"""
import json
import os
import platform
import statistics
import tempfile
import time
from typing import Callable, Dict, Iterable, List, Optional

import torch

__all__ = ['backbone_shapes', 'layer_step', 'peak_step_bytes', 'peak_of_memory_events', 'interleaved_times', 'median',
           'machine', 'load_average', 'synchronize', 'spread', 'step_macs']


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (``uptime``), or '?' where the OS does not say."""
    try:
        return ' '.join(f'{x:.2f}' for x in os.getloadavg())
    except OSError:
        return '?'


def cpu_model() -> str:
    """The CPU's model name and family (``lscpu``'s; machines of one kind differ in CPU), from /proc/cpuinfo."""
    try:
        with open('/proc/cpuinfo') as f:
            info = dict(line.split(':', 1) for line in f.read().split('\n\n')[0].splitlines() if ':' in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model {info.get('model', '?')})"
    except OSError:
        return platform.processor() or platform.machine()


def commit(checkout: Optional[str] = None) -> str:
    """The checkout's commit (``git rev-parse HEAD``, ``+dirty`` where tracked files outside docs/ and README.md
    differ: the code measured, not a results file a run of several parts is writing), ``$TIMM_LAMBDA_COMMIT``
    where set (a copied tree), else ``'unknown'``: what every committed result names. ``checkout``: another
    checkout's (benchmarks/before_after.py's older one), never the environment's."""
    if checkout is None and os.environ.get('TIMM_LAMBDA_COMMIT'):
        return os.environ['TIMM_LAMBDA_COMMIT']
    import subprocess
    root = checkout or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no', '--', '.', ':(exclude)docs',
                                ':(exclude)README.md'], cwd=root, capture_output=True, text=True).stdout.strip()
        return head.stdout.strip() + ('+dirty' if dirty else '')
    except (OSError, subprocess.CalledProcessError):
        return 'unknown'


def machine(device: str = 'cpu') -> str:
    """One line naming the device, threads, torch version and the load when called."""
    if device.startswith('cuda'):
        what = torch.cuda.get_device_name()
    else:
        what = f'{cpu_model()} CPU, {os.cpu_count()} cores, {torch.get_num_threads()} threads'
    return f'{what}, torch {torch.__version__}, load average {load_average()}'


def synchronize(device: str) -> None:
    if device.startswith('cuda'):
        torch.cuda.synchronize()


_CPU_DEVICE_TYPES = (0, 2, 5)  # c10::DeviceType CPU, MKLDNN, IDEEP: the CPU allocator's events


def peak_of_memory_events(events: Iterable[dict]) -> int:
    """Peak bytes of the blocks allocated during a profile and alive at the same time, from the ``[memory]``
    events of its Chrome trace (``args``: ``Addr``, ``Bytes``, positive when allocated, negative when freed).

    The free of a block allocated before the profile started is ignored: what existed before is not counted,
    so the figure does not depend on what ran before.
    """
    live = {}  # address -> bytes of the blocks allocated during the profile and not yet freed
    current = peak = 0
    records = sorted((e for e in events if e.get('name') == '[memory]'
                      and e['args'].get('Device Type') in _CPU_DEVICE_TYPES), key=lambda e: e['ts'])
    for e in records:
        addr, nbytes = e['args']['Addr'], e['args']['Bytes']
        if nbytes > 0:
            current += nbytes - live.get(addr, 0)
            live[addr] = nbytes
            peak = max(peak, current)
        elif addr in live:
            current -= live.pop(addr)
    return peak


def _cpu_peak_bytes(step: Callable[[], object]) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, 'trace.json')
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)['traceEvents']
    return peak_of_memory_events(events)


def peak_step_bytes(step: Callable[[], object], device: str = 'cpu', warmup: int = 1) -> int:
    """Peak memory one call of ``step`` adds above what was allocated before it (see the module docstring),
    after ``warmup`` untracked calls (so that caches built on a first call are not counted)."""
    for _ in range(warmup):
        step()
    if device.startswith('cuda'):
        synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated() - base
    return _cpu_peak_bytes(step)


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


def step_macs(step: Callable[[], object]) -> int:
    """Multiply-adds of one call of ``step``: ``torch.utils.flop_counter`` (the custom operators have FLOP
    formulas) / 2."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops() // 2


def graphed_step(label: str, module, shape, device: str, dry_run: bool = False, repeats: int = 15,
                 reduce_overhead: bool = False) -> dict:
    """A training step of ``module`` on a random ``shape`` input eager, against the same step replayed from a CUDA
    graph (``torch.cuda.make_graphed_callables`` of a copy: it replaces a module's forward), interleaved; medians in
    ms. ``reduce_overhead``: also a copy under ``torch.compile(mode='reduce-overhead')`` (inductor's CUDA graphs; its
    compile and capture time, the first two steps, reported apart). ``dry_run`` (a CPU, no graphs, no compile): eager
    in every role, one round. A module that cannot be captured or compiled: the error."""
    import copy
    module.train()
    x = torch.randn(*shape, device=device, requires_grad=True)
    try:
        graphed = module if dry_run else torch.cuda.make_graphed_callables(copy.deepcopy(module), (x,))
    except Exception as e:
        return dict(case=label, error=f'{type(e).__name__}: {e}'[:1000])

    def step(m):
        def run():
            out = m(x)
            out = torch.cat([o.flatten() for o in out]) if isinstance(out, (list, tuple)) else out
            out.float().sum().backward()
        return run
    steps = {'eager': step(module), 'graphed': step(graphed)}
    row = dict(case=label)
    if reduce_overhead:
        compiled = step(module if dry_run else torch.compile(copy.deepcopy(module), mode='reduce-overhead'))

        def compiled_step():
            if not dry_run:
                torch.compiler.cudagraph_mark_step_begin()  # a new training step: the last one's outputs are free
            compiled()
        try:
            t0 = time.perf_counter()
            for _ in range(2):  # compile, then record the graph
                compiled_step()
            synchronize(device)
            row['compile_and_capture_s'] = round(time.perf_counter() - t0, 1)
            steps['compiled'] = compiled_step
        except Exception as e:
            row['compiled_error'] = f'{type(e).__name__}: {e}'[:1000]
    times = interleaved_times(steps, repeats=1 if dry_run else repeats, warmup=0 if dry_run else 3, device=device)
    eager = median(times['eager'])
    for name in steps:
        row[f'{name}_ms'] = round(1e3 * median(times[name]), 3)
    row['ratio'] = round(median(times['graphed']) / eager, 3)
    if 'compiled' in steps:
        row['ratio_compiled'] = round(median(times['compiled']) / eager, 3)
    print(row, flush=True)
    return row


def backbone_shapes(image_size: int = 1024):
    """(width, input side, stride) of a LambdaResNet-101's lambda layers at ``image_size``: c4 (stride 16), the
    stride-2 first c5 block, the other c5 blocks (stride 32)."""
    c4, c5 = -(-image_size // 16), -(-image_size // 32)
    return [(256, c4, 1), (512, c4, 2), (512, c5, 1)]


def layer_step(layer, x, dtype, mode='train'):
    """One training step (forward + backward, the input needing grad) or, ``mode='eval'``, one eval-mode
    inference (``torch.no_grad``)."""
    def run():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
            y = layer(x)
        y.float().sum().backward()

    def infer():
        with torch.no_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
            layer(x)
    return run if mode == 'train' else infer
