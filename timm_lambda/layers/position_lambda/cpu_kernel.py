"""The tiled form's exact CPU kernels (``tiled_cpu.h``; ``tiled_cpu.cpp``: float32 and float64; ``tiled_cpu_bf16.cpp``:
bfloat16): built at install with the machine's C++ compiler (``python -m timm_lambda.build_cpu_kernel``, which
``tools/install.sh`` runs: :func:`build`), only loaded at run time (:func:`load`), never compiled inside a training
step.

Each query meets exactly its ``K_h x K_w`` scope (the GEMM path pads it to its block's window, 1.7x the work at a
23x23 scope) and its logits never leave the cache, so the layer runs near the CPU's multiply-add rate
(docs/benchmarks.md). float32 and float64 on a CPU. bfloat16 (CPU autocast) on a CPU with AVX-512 BF16 runs in
bfloat16 itself, at both strides, as a bfloat16 matmul computes: the logits rounded to bfloat16, products of bfloat16
operands summed in float32 by VDPBF16PS (``tiled_forward_bf16``, ``tiled_backward_bf16``). Other 16-bit calls run in
float32, the result rounded back. :class:`CpuKernel` is the ``cpu_kernel`` backend (:mod:`.backends`), which says
where ``'auto'`` runs it: not where the kernel is not built (one warning names the command, or the failed build's
cause: :func:`unavailable`), nor where :func:`declines` says the gemm backend is faster. A float32 or float64 call
at stride 1 (or pooled after at stride 2) is one kernel call a direction, the content lambda of every key norm and
the table's reach included (``layer_forward``, ``layer_backward``: :func:`whole_call`), without the dozen ATen calls
from Python around the kernels that :class:`.fused.Tiled` makes (the host time of a small map's step: issue 58).

The kernel's vectors are the compiler target's (``tiled_cpu.h``): 16 float32 lanes with AVX-512, 8 with AVX2 + FMA,
4 elsewhere, its register tiles sized to the ISA's registers; :func:`isa` reads which from the build. The target is
``-march=native`` unless ``TIMM_LAMBDA_CPU_ARCH`` names another (:func:`arch`: a separate build, e.g. ``x86-64-v3``
to measure an AVX2 CPU's kernel on an AVX-512 one; :func:`load_target` loads one beside the serving build).

One build per CPU, torch, Python and kernel source (:func:`_name`) in torch's extension cache
(``$TORCH_EXTENSIONS_DIR``); a build supersedes those of the same CPU, torch and Python with another source, and
builds unused for :data:`PRUNE_DAYS` days go (:func:`_prune`; docs/install.md).
"""
import contextlib
import errno
import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from typing import List, Optional, Tuple

import torch

from ..._env import env
from ..execution import BackendUnusable
from .backends import Call
from .fused import Tiled, pool, pool_backward

try:
    import fcntl
except ImportError:  # not POSIX: torch's own lock alone serialises the builds
    fcntl = None

__all__ = ['CpuKernel', 'forward', 'backward', 'native', 'compute_dtype', 'compute_path', 'brgemm_isa', 'build',
           'load', 'load_target', 'serving', 'unavailable', 'isa', 'declines', 'arch', 'CpuKernelBuildError', 'PATHS']

_logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_HERE, name) for name in ('tiled_cpu.cpp', 'tiled_cpu_bf16.cpp', 'tiled_cpu_brgemm.cpp')]
_HEADER = os.path.join(_HERE, 'tiled_cpu.h')
_CFLAGS = ['-O3', '-march=native', '-fopenmp']  # '-march=' + arch() in place of native (_cflags)
ARCH_ENV = 'TIMM_LAMBDA_CPU_ARCH'
_LDFLAGS = ['-fopenmp']
_PREFIX = 'timm_lambda_tiled_cpu_'
_STAMP = 'timm_lambda_build.json'  # written last by a build: its .so's size and mtime (a half-written one never loads)
_LOCK = 'timm_lambda.lock'
PRUNE_DAYS = 30
COMMAND = 'python -m timm_lambda.build_cpu_kernel'


def _cpu_flags() -> str:
    """The CPU's flags line of /proc/cpuinfo ('' elsewhere)."""
    if not os.path.exists('/proc/cpuinfo'):
        return ''
    with open('/proc/cpuinfo') as f:
        return next((line for line in f if line.startswith(('flags', 'Features'))), '')


def arch() -> str:
    """The compiler's target, ``-march=<arch>``: ``$TIMM_LAMBDA_CPU_ARCH``, default ``native`` (this CPU's whole
    instruction set). Another value builds, and loads, a separate build: e.g. ``x86-64-v3`` (AVX2 + FMA, no AVX-512),
    to measure or test that class of CPU on an AVX-512 machine, or a build for a cache shared by older CPUs."""
    return env(ARCH_ENV)


def _cflags(target: Optional[str] = None) -> List[str]:
    target = target or arch()
    return [f'-march={target}' if flag == '-march=native' else flag for flag in _CFLAGS]


@functools.lru_cache(maxsize=None)
def _tags(target: str = 'native') -> Tuple[str, str, str]:
    """The build name's three parts: the CPU and the target (``-march=native`` code must not load on another CPU
    sharing the cache; a build for another ``-march`` is another CPU's, so neither supersedes the other), torch and
    Python (the module's ABI), and the kernel's sources and flags (torch's own check is the files' mtimes, and misses
    the header)."""
    sources = ' '.join(_cflags('native') + _LDFLAGS).encode()
    for path in _SOURCES + [_HEADER]:
        with open(path, 'rb') as f:
            sources += f.read()
    env = f'{torch.__version__} {sys.implementation.cache_tag}{getattr(sys, "abiflags", "")}'
    cpu = f'{platform.machine()} {_cpu_flags()}' + ('' if target == 'native' else f' -march={target}')
    parts = (cpu.encode(), env.encode(), sources)
    return tuple(hashlib.sha1(p).hexdigest()[:8] for p in parts)


def _name(target: Optional[str] = None) -> str:
    """The extension's name, also its folder in torch's extension cache: ``timm_lambda_tiled_cpu_<cpu and
    target>_<torch and python>_<source>`` (target: :func:`arch`)."""
    return _PREFIX + '_'.join(_tags(target or arch()))


def _command() -> str:
    """:data:`COMMAND` with this environment's python (the build is for its torch and Python)."""
    return f'{shlex.quote(sys.executable)} -m timm_lambda.build_cpu_kernel' if sys.executable else COMMAND


_FALLBACK = 'the position lambdas run as batched GEMMs instead (correct, about half as fast)'


class CpuKernelBuildError(RuntimeError):
    """The kernel could not be built: the cause and its remedy on the first line, torch's output after it."""


def _build_failed(e: Exception, build_dir: Optional[str]) -> str:
    """The message of a failed build: the cause and its remedy on the first line, torch's output (its banner and
    the compiler's messages, kilobytes) after it."""
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        where = build_dir or getattr(e, 'filename', None) or "torch's extension cache"
        first = (f'the tiled form\'s CPU kernel could not be built: its build folder {where} is not writable; set '
                 f'TORCH_EXTENSIONS_DIR to a writable folder (at run time too); {_FALLBACK}')
    else:
        first = (f'the tiled form\'s CPU kernel could not be built ({type(e).__name__}): install a C++ compiler with '
                 f'OpenMP (g++, or clang++ with libomp) or see its output below; {_FALLBACK}')
    return f'{first}\n{str(e)[-3000:]}\n'


def _not_built(build_dir: Optional[str]) -> str:
    """Why the kernel cannot serve where no complete build exists: the one command that builds it."""
    where = build_dir or "torch's extension cache"
    return (f"the tiled form's CPU kernel is not built for this CPU, torch {torch.__version__} and Python "
            f"{platform.python_version()} (in {where}): build it once with "
            f"`{_command()}` (tools/install.sh runs it; about 40 s on 2 cores); {_FALLBACK}; TIMM_LAMBDA_BACKEND=gemm "
            f"chooses them without this warning")


def _build_dir(name: str) -> Optional[str]:
    """torch's build folder for extension ``name`` (``$TORCH_EXTENSIONS_DIR/name`` or torch's default; private API,
    ``torch.utils.cpp_extension._get_build_directory``, which also creates it), or None where that fails."""
    from torch.utils import cpp_extension
    try:
        return cpp_extension._get_build_directory(name, False)
    except OSError:  # a folder it cannot create
        return None


@contextlib.contextmanager
def _locked(folder: str, blocking: bool = True):
    """Hold ``folder``'s build lock (``flock`` on its ``timm_lambda.lock``): one build of a folder at a time, across
    processes. The system drops the lock when its holder dies, so a killed build never blocks the next one (older
    torch's ``FileBaton``, a file whose existence is the lock, does: :func:`_compile`). Yields False where
    ``blocking`` is False and another process holds it, or removed the folder between this one's open and lock (the
    lock is then of a deleted file: two pruners would both remove, and count, the same build)."""
    if fcntl is None:
        yield True
        return
    path = os.path.join(folder, _LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        if not blocking and not _same_file(fd, path):
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _import(name: str, path: str):
    """The extension module ``name`` from its shared library ``path`` (as torch's ``cpp_extension`` imports it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(build_dir: Optional[str], name: Optional[str] = None) -> Tuple[Optional[object], Optional[str]]:
    """The complete build ``name`` (default :func:`_name`) in ``build_dir`` (its .so as its stamp records it; one being
    written, or left half written by a killed build, differs) imported, and None; or None and why not."""
    if build_dir is None:
        return None, _not_built(None)
    name = name or _name()
    path, stamp = os.path.join(build_dir, name + '.so'), os.path.join(build_dir, _STAMP)
    try:
        with open(stamp) as f:
            recorded = json.load(f)
        st = os.stat(path)
    except (OSError, ValueError):
        return None, _not_built(build_dir)
    if (recorded.get('size'), recorded.get('mtime_ns')) != (st.st_size, st.st_mtime_ns):
        return None, _not_built(build_dir)
    try:
        module = _import(name, path)
    except (ImportError, OSError) as e:  # a missing libgomp, a file damaged since
        return None, (f"the tiled form's CPU kernel's build {path} does not load ({type(e).__name__}: {e}): rebuild "
                      f"it with `{_command()}`; {_FALLBACK}")
    with contextlib.suppress(OSError):  # its last use, for _prune (a read-only cache keeps its date)
        os.utime(stamp)
    return module, None


def _compile(cpp_extension, name: str, build_dir: str, verbose: bool):
    """Compile and load the kernel in ``build_dir`` (its lock held), then stamp it."""
    global _compiled
    path = os.path.join(build_dir, name + '.so')
    baton = os.path.join(build_dir, 'lock')
    if hasattr(cpp_extension, 'FileBaton') and os.path.exists(baton):
        os.remove(baton)  # older torch's FileBaton: left by a killed build (every builder holds our lock)
    if os.path.exists(path):
        os.remove(path)  # not stamped: half written by a killed build, or it does not load; ninja would keep it
    _logger.info("timm_lambda: building the tiled form's CPU kernel (about 40 s on 2 cores) into %s", build_dir)
    t0 = time.monotonic()
    kernel = cpp_extension.load(name, _SOURCES, extra_cflags=_cflags(), extra_ldflags=_LDFLAGS,
                                build_directory=build_dir, verbose=verbose)
    st = os.stat(path)
    stamp = dict(size=st.st_size, mtime_ns=st.st_mtime_ns, torch=torch.__version__,
                 python=platform.python_version(), bf16=bool(kernel.bf16), arch=arch(),
                 isa_macros=list(getattr(kernel, 'isa_macros', list)()), seconds=round(time.monotonic() - t0, 1),
                 built=time.strftime('%Y-%m-%d %H:%M:%S'))
    tmp = os.path.join(build_dir, f'{_STAMP}.{os.getpid()}')
    with open(tmp, 'w') as f:
        json.dump(stamp, f)
    os.replace(tmp, os.path.join(build_dir, _STAMP))  # last: a reader sees a complete build or none
    _compiled = True
    return kernel


def _idle_days(folder: str) -> float:
    """Days since ``folder``'s build was last loaded (its stamp's mtime) or, unstamped (older versions of this
    package), last written."""
    stamp = os.path.join(folder, _STAMP)
    paths = [stamp] if os.path.exists(stamp) else [folder] + [os.path.join(folder, n) for n in os.listdir(folder)]
    return (time.time() - max(os.path.getmtime(p) for p in paths)) / 86400


def _prune(root: str, keep: str) -> List[str]:
    """Remove the kernel builds in ``root`` that ``keep`` supersedes (same CPU, torch and Python, another source) or
    that no process has loaded for :data:`PRUNE_DAYS` days (another CPU sharing the cache, e.g. an NFS home, loads
    its own at each start, so keeps it); never one being built (its lock held). Their names."""
    kept = keep[len(_PREFIX):].split('_')
    removed = []
    for entry in sorted(os.listdir(root)):
        folder = os.path.join(root, entry)
        if not entry.startswith(_PREFIX) or entry == keep or not os.path.isdir(folder):
            continue
        parts = entry[len(_PREFIX):].split('_')
        try:
            if not ((len(parts) == 3 and parts[:2] == kept[:2]) or _idle_days(folder) > PRUNE_DAYS):
                continue
            with _locked(folder, blocking=False) as free:
                if not free:
                    continue
                # renamed away first, atomically: a pruner that opens the lock while rmtree empties the folder
                # would create a new lock file there, take it, and remove (and count) the same build again
                gone = os.path.join(root, f'.{entry}.removed.{os.getpid()}')
                os.rename(folder, gone)
                shutil.rmtree(gone, ignore_errors=True)
        except OSError:  # read-only, or removed by another process meanwhile
            continue
        shutil.rmtree(gone, ignore_errors=True)  # what an open lock file left (NFS renames it until closed)
        removed.append(entry)
    return removed


_kernel = None  # the kernel module, once loaded or built in this process
_reason = None  # why it cannot serve, after a lookup that found none
_failed = None  # a failed build's cause (its first line), in this process
_looked_up = False
_compiled = False  # whether this process's last build() compiled (else it found the build complete)


def build(verbose: bool = False):
    """Build the kernel for this CPU, torch, Python and source into torch's extension cache, or load that build
    where it is complete; prune the builds it supersedes (:func:`_prune`). The module. Two processes at once: one
    builds, the other waits for it and loads its build (:func:`_locked`). ``verbose``: torch's build output.

    Raises :class:`CpuKernelBuildError` (no compiler, a failed compile, a read-only cache), its first line the cause
    and the remedy."""
    global _kernel, _failed, _compiled
    _compiled = False
    try:
        kernel = _build(verbose)
    except CpuKernelBuildError as e:
        _kernel, _failed = None, str(e).splitlines()[0]
        raise
    _kernel, _failed = kernel, None
    return kernel


def _build(verbose: bool):
    from torch.utils import cpp_extension
    try:
        import ninja  # the pip package (a dependency): torch runs `ninja`, on PATH only in an active venv
        if shutil.which('ninja') is None:
            os.environ['PATH'] = ninja.BIN_DIR + os.pathsep + os.environ.get('PATH', '')
    except ImportError:
        pass
    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:  # torch would print its ABI banner, then fail kilobytes later
        raise CpuKernelBuildError(f'the tiled form\'s CPU kernel was not built: no C++ compiler ({compiler!r}, $CXX '
                                  f'or c++ on PATH); install one with OpenMP, e.g. g++; {_FALLBACK}')
    name, build_dir = _name(), None
    try:
        build_dir = cpp_extension._get_build_directory(name, verbose)
        with _locked(build_dir):
            kernel = _load(build_dir)[0]
            if kernel is None:
                kernel = _compile(cpp_extension, name, build_dir, verbose)
    except (OSError, ImportError, RuntimeError, subprocess.SubprocessError) as e:  # no ninja, no OpenMP, read-only
        # (torch's cpp_extension raises RuntimeError for a compiler or ninja failure); any other error is a bug
        raise CpuKernelBuildError(_build_failed(e, build_dir)) from e
    removed = _prune(os.path.dirname(build_dir), name)
    if removed:
        _logger.info('timm_lambda: removed %d older CPU kernel build(s) from %s: %s', len(removed),
                     os.path.dirname(build_dir), ', '.join(removed))
    return kernel


def load():
    """The kernel's complete build for this CPU, torch, Python and source, loaded without compiling, or None where
    there is none (or it does not load: :func:`unavailable` says why). Looks again at each call until it finds one."""
    global _kernel, _reason
    if _kernel is None:
        _kernel, _reason = _load(_build_dir(_name()))
    return _kernel


def load_target(target: str):
    """The complete build for ``-march=<target>`` (see :func:`arch`; built by ``TIMM_LAMBDA_CPU_ARCH=<target> python -m
    timm_lambda.build_cpu_kernel``) loaded without compiling, or None; it does not serve (a benchmark or test compares
    builds side by side in one process: benchmarks/benchmark_cpu_isa.py)."""
    name = _name(target)
    return _load(_build_dir(name), name)[0]


@contextlib.contextmanager
def serving(module):
    """Within the block, ``module`` (a build of the kernel: :func:`load_target`, or one built with other flags, such
    as AddressSanitizer's) serves every ``cpu_kernel`` call instead of this machine's build; the plans are made anew on
    entry and exit (:func:`.backends.invalidate`): a benchmark or a test measures or checks another build through the
    layer. Not thread-safe."""
    from . import backends
    global _kernel, _looked_up
    before = _kernel, _looked_up
    _kernel, _looked_up = module, True
    backends.invalidate()
    try:
        yield module
    finally:
        _kernel, _looked_up = before
        backends.invalidate()


def _look_up():
    """:func:`load` once per process."""
    global _looked_up
    if not _looked_up:
        _looked_up = True
        load()


def unavailable() -> Optional[str]:
    """Why the kernel cannot serve, or None where it can: a build that failed in this process (its cause), or no
    build (the command that makes one). Looks the build up once per process."""
    _look_up()
    if _kernel is not None:
        return None
    return _failed or _reason


def native(dtype: torch.dtype) -> bool:
    """Whether the kernel can compute a ``dtype`` call in that dtype itself: bfloat16 where the compiler targets AVX-512
    BF16 (its bfloat16 paths, :func:`compute_path`); other 16-bit calls run in float32."""
    _look_up()
    return dtype == torch.bfloat16 and _kernel is not None and _kernel.bf16


def brgemm_isa() -> str:
    """The micro-kernel that runs the kernel's bfloat16 BRGEMM products (torch's ``at::native::cpublas::brgemm``,
    oneDNN's BRGEMM): ``'amx'`` (AMX tiles: oneDNN's effective ISA has AMX-BF16, torch's ``cpublas::could_pack``),
    ``'avx512'`` (oneDNN's AVX-512 BF16 micro-kernel: a CPU without AMX, or ``ONEDNN_MAX_CPU_ISA`` below it), or
    ``''`` where it cannot run (no bfloat16 build, oneDNN without AVX-512 BF16, ``torch.backends.mkldnn`` disabled).
    Found by one small product checked exactly (``brgemm_bf16_isa``), once per process and setting of
    ``torch.backends.mkldnn``."""
    _look_up()
    if not native(torch.bfloat16):
        return ''
    key = torch._C._get_mkldnn_enabled()
    if key not in _BRGEMM_ISA:
        _BRGEMM_ISA[key] = _kernel.brgemm_bf16_isa()
    return _BRGEMM_ISA[key]


_BRGEMM_ISA = {}
PATH_ENV = 'TIMM_LAMBDA_CPU_BF16'  # forces the path of bfloat16 calls (tests, benchmarks): one of BF16_PATHS
BF16_PATHS = ('brgemm', 'avx512_bf16', 'float32')
_VENDOR = None


def _vendor() -> str:
    """The CPU's vendor_id (/proc/cpuinfo: 'GenuineIntel', 'AuthenticAMD'), '' elsewhere."""
    global _VENDOR
    if _VENDOR is None:
        _VENDOR = ''
        if os.path.exists('/proc/cpuinfo'):
            with open('/proc/cpuinfo') as f:
                _VENDOR = next((line.split(':', 1)[1].strip() for line in f if line.startswith('vendor_id')), '')
    return _VENDOR


@torch.compiler.assume_constant_result  # (it reads the build: under torch.compile, once while tracing)
def compute_path(dtype: torch.dtype, step: int = 1) -> Tuple[str, str]:
    """How the kernel computes a call of ``dtype`` at ``step`` (1 or 2): ``(path, why)``, the path one of
    ``'float64'``, ``'float32'`` (a 16-bit call's inputs converted, its results rounded back), ``'brgemm'`` (bfloat16
    products by oneDNN's BRGEMM micro-kernel, ``tiled_*_brgemm``: on AMX tiles where :func:`brgemm_isa` is ``'amx'``),
    ``'avx512_bf16'`` (bfloat16 products by the kernel's own VDPBF16PS loops, ``tiled_*_bf16``); ``why`` a sentence
    for ``served_backends(why=True)``. bfloat16, measured (benchmarks/benchmark_cpu_isa.py, docs/cpu_bfloat16.md):
    on AMX the BRGEMM path; on an AMD CPU with AVX-512 BF16 the VDPBF16PS loops (faster than float32 at every shape
    on Zen 4 and Zen 5, and than oneDNN's AVX-512 BF16 BRGEMM on Zen 5); on an Intel CPU with AVX-512 BF16 but no
    AMX for oneDNN, float32; float32 without AVX-512 BF16. ``$TIMM_LAMBDA_CPU_BF16`` (one of :data:`BF16_PATHS`)
    forces a bfloat16 path that this build can run (``'brgemm'`` then runs oneDNN's micro-kernel of this CPU, AMX
    or AVX-512 BF16)."""
    if dtype in _SAME:  # (host time: this runs twice a training step of each layer)
        return _SAME[dtype]
    bf16 = dtype == torch.bfloat16 and native(dtype)
    return _compute_path(dtype, step, bf16, brgemm_isa() if bf16 else '', _vendor(), env(PATH_ENV))


_SAME = {torch.float32: ('float32', 'float32 in float32'), torch.float64: ('float64', 'float64 in float64')}


@functools.lru_cache(maxsize=64)
def _compute_path(dtype: torch.dtype, step: int, bf16: bool, isa: str, vendor: str, forced: str) -> Tuple[str, str]:
    """:func:`compute_path` of its inputs (``bf16``: :func:`native` bfloat16; ``isa``: :func:`brgemm_isa`)."""
    if dtype in _SAME:
        return _SAME[dtype]
    if not bf16:
        return 'float32', (f'{str(dtype)[6:]} in float32 (converted, results rounded back): the kernel has no '
                           f'{str(dtype)[6:]} products' + ('' if dtype != torch.bfloat16 else
                                                           ' without AVX-512 BF16 in its build'))
    if forced:
        if forced == 'brgemm' and not isa:
            raise ValueError(f"{PATH_ENV}=brgemm, but oneDNN's BRGEMM cannot run bfloat16 here")
        return forced, f'bfloat16 by the {forced} path ({isa or "no BRGEMM"}), forced by {PATH_ENV}'
    if isa == 'amx':
        return 'brgemm', 'bfloat16 on AMX tiles (oneDNN BRGEMM by torch cpublas::brgemm)'
    if vendor == 'AuthenticAMD':
        return 'avx512_bf16', 'bfloat16 by AVX-512 BF16 (VDPBF16PS; faster than float32 on AMD, no AMX)'
    return 'float32', ('bfloat16 in float32 (converted, results rounded back): without AMX, AVX-512 BF16 is slower '
                       'than float32 on this Intel CPU (docs/benchmarks.md)')


def compute_dtype(dtype: torch.dtype, step: int = 1) -> torch.dtype:
    """The dtype the kernel computes a ``dtype`` input at ``step`` in (:func:`compute_path`)."""
    path = compute_path(dtype, step)[0]
    return {'float64': torch.float64, 'float32': torch.float32}.get(path, torch.bfloat16)


_ISA_OF_MACROS = (('avx512_bf16', {'__AVX512BF16__', '__AVX512F__'}), ('avx512', {'__AVX512F__'}),
                  ('avx2', {'__AVX2__', '__FMA__'}), ('neon', {'__ARM_NEON'}))
_ISA_OF_FLAGS = (('avx512_bf16', {'avx512_bf16', 'avx512f'}), ('avx512', {'avx512f'}), ('avx2', {'avx2', 'fma'}),
                 ('neon', {'asimd'}))
ISA_NAMES = dict(avx512_bf16='AVX-512 BF16', avx512='AVX-512', avx2='AVX2 + FMA', neon='NEON',
                 none='16-byte vectors (SSE or baseline)')
FAST_ISAS = ('avx512_bf16', 'avx512', 'avx2')  # where the kernel's vectors outrun the gemm backend's GEMMs
_16_BIT = (torch.float16, torch.bfloat16)


def isa() -> str:
    """The instruction set the kernel computes with: ``'avx512_bf16'``, ``'avx512'``, ``'avx2'`` (AVX2 + FMA, 8 float32
    lanes), ``'neon'`` or ``'none'`` (e.g. SSE only). Read from the loaded build's compiler macros
    (``isa_macros()``: which of ``__AVX512BF16__``, ``__AVX512F__``, ``__AVX2__``, ``__FMA__``, ``__ARM_NEON`` the
    compiler defined); where none is loaded, from this CPU's flags (a ``-march=native`` build's)."""
    _look_up()
    if _kernel is not None and hasattr(_kernel, 'isa_macros'):
        have, table = set(_kernel.isa_macros()), _ISA_OF_MACROS
    else:
        have, table = set(_cpu_flags().partition(':')[2].split()), _ISA_OF_FLAGS
    return next((name for name, needs in table if needs <= have), 'none')


def _bf16_gemms() -> bool:
    """Whether the gemm backend's 16-bit GEMMs run on AVX-512 BF16 (oneDNN's, on a CPU that has it and where
    ``ONEDNN_MAX_CPU_ISA`` does not hold oneDNN below AVX-512): where they do not, they convert in software."""
    cap = (os.environ.get('ONEDNN_MAX_CPU_ISA') or os.environ.get('DNNL_MAX_CPU_ISA') or 'ALL').upper()
    return 'avx512_bf16' in _cpu_flags().split() and (cap == 'ALL' or 'AVX512' in cap or 'AMX' in cap)


def declines(dtype: torch.dtype, step: int) -> Optional[str]:
    """Why ``'auto'`` passes over the kernel for a call of ``dtype`` at ``step`` (1 or 2) although it could compute
    it, a reason starting ``'auto: '`` that names the instruction set; None where the kernel is the fast choice
    (measured: benchmarks/benchmark_cpu_isa.py, docs/benchmarks.md, "CPU"). The kernel's vectors are the
    instruction set's (:func:`isa`): without AVX2 and FMA (SSE, NEON) the gemm backend's GEMMs, by the BLAS's tuned
    kernels, are faster; a 16-bit stride-2 call that the kernel runs in float32 (a build without AVX-512 BF16) is
    slower than the gemm backend's 16-bit GEMMs where those run on AVX-512 BF16 (:func:`_bf16_gemms`); on an AVX2 CPU
    they do not, and the kernel's float32 is the faster (benchmarks/benchmark_cpu_isa.py)."""
    name = isa()
    if name not in FAST_ISAS:
        return (f"auto: the CPU kernel was built for {ISA_NAMES[name]} (-march={arch()}), without AVX2 + FMA; the "
                "gemm backend's GEMMs are faster here (docs/benchmarks.md)")
    if step == 2 and dtype in _16_BIT and not native(dtype) and _bf16_gemms():
        return (f"auto: the CPU kernel was built for {ISA_NAMES[name]}, without AVX-512 BF16: a 16-bit stride-2 call "
                "runs faster as the gemm backend's 16-bit GEMMs (on this CPU's AVX-512 BF16) than in float32 here "
                "(docs/benchmarks.md)")
    return None


def _module():
    """The loaded kernel; :class:`.execution.BackendUnusable` where there is none (the backend table asks
    :func:`unavailable` first: this is a kernel that went away since)."""
    if _kernel is None:
        _look_up()
    if _kernel is None:
        raise BackendUnusable(unavailable() or 'not loaded')
    return _kernel


def _to(x: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``x`` in ``dtype`` (None stays None; no call where it already is: ``.to`` costs ~2 us of host time a call)."""
    return x if x is None or x.dtype == dtype else x.to(dtype)


def forward(q: torch.Tensor, v: torch.Tensor, table: torch.Tensor, step: int, content: Optional[torch.Tensor] = None,
            path: Optional[str] = None) -> torch.Tensor:
    """The tiled kernels' output (layouts: :meth:`.fused.Tiled.tiled_forward`) by ``path`` (default
    :func:`compute_path`'s; the plan's), returned in ``q``'s dtype."""
    kernel, path = _module(), path or compute_path(q.dtype, step)[0]
    if path == 'brgemm':
        return kernel.tiled_forward_brgemm(q, v, table, content, step)
    if path == 'avx512_bf16':
        return kernel.tiled_forward_bf16(q, v, table, content, step)
    c = torch.float64 if path == 'float64' else torch.float32
    return _to(kernel.tiled_forward(_to(q, c), _to(v, c), _to(table, c), _to(content, c), step), q.dtype)


def backward(gy: torch.Tensor, q: torch.Tensor, v: torch.Tensor, table: torch.Tensor, step: int,
             content: Optional[torch.Tensor] = None, path: Optional[str] = None):
    """The gradients of q, v, the table and the content lambda (an empty tensor without one) in the inputs' dtypes,
    by ``path`` (default :func:`compute_path`'s; a bfloat16 call's computed from its bfloat16 operands, summed in
    float32)."""
    kernel, path = _module(), path or compute_path(q.dtype, step)[0]
    c = {'float64': torch.float64, 'float32': torch.float32}.get(path, torch.bfloat16)
    if path == 'brgemm':
        gq, gv, gtable, gcontent = kernel.tiled_backward_brgemm(_to(gy, c), q, v, table, content, step)
    elif path == 'avx512_bf16':
        gq, gv, gtable, gcontent = kernel.tiled_backward_bf16(_to(gy, c), q, v, table, content, step)
    else:
        gq, gv, gtable, gcontent = kernel.tiled_backward(_to(gy, c), _to(q, c), _to(v, c), _to(table, c),
                                                         _to(content, c), step)
    return (_to(gq, q.dtype), _to(gv, v.dtype), _to(gtable, table.dtype),
            _to(gcontent, v.dtype if content is None else content.dtype))


PATHS = ('float64', 'float32', 'brgemm', 'avx512_bf16')  # the plan's tiling names one by its index


def whole_call(plan) -> bool:
    """Whether the kernel runs a call of the plan whole (``layer_forward``, ``layer_backward``: the content lambda,
    the table's reach and the kernels in one call, host time a small map would spend on a dozen ATen calls from
    Python): the plan's second tiling entry, set by :meth:`CpuKernel.kernel_tiling` for a kernel call at stride 1 (a
    stride-1 call, or a stride-2 one pooled after) computed in float32 or float64 (a 16-bit call by the float32
    path too: its inputs converted once, its results rounded back once). Other calls: :class:`.fused.Tiled`'s steps
    around the kernels."""
    return bool(plan.tiling[1])


def _widened(plan, *xs: Optional[torch.Tensor]) -> list:
    """A whole call's tensors in the dtype its path computes in (:func:`whole_call`: float32 or float64)."""
    c = torch.float64 if PATHS[plan.tiling[0]] == 'float64' else torch.float32
    return [_to(x, c) for x in xs]


class CpuKernel(Tiled):
    """The ``cpu_kernel`` backend: the tiled form by this module's C++ kernels on CPU tensors; float32 and float64;
    bfloat16 by the path :func:`compute_path` measured fastest on this CPU (AMX by oneDNN's BRGEMM, AVX-512 BF16's
    VDPBF16PS loops, or float32), other 16-bit calls computed in float32. Its plans name the path in their tiling."""
    name = 'cpu_kernel'
    devices = ('cpu',)

    def unavailable(self) -> Optional[str]:
        return unavailable()

    def declines(self, call: Call) -> Optional[str]:
        return declines(call.dtype, call.stride)

    def computes_as(self, call: Call) -> str:
        return compute_path(call.dtype, call.stride)[1]

    def kernel_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """:func:`compute_dtype`."""
        return compute_dtype(dtype)

    def kernel_tiling(self, device: str, dtype: torch.dtype, step: int, c: int, kw: int):
        """The path (:func:`compute_path`), as its index in :data:`PATHS`, and whether the call runs whole
        (:func:`whole_call`)."""
        path = compute_path(dtype, step)[0]
        return PATHS.index(path), int(step == 1 and path in ('float32', 'float64'))

    def forward(self, plan, q, keys, v, table, shared):
        """:meth:`.fused.Tiled.forward`; a call the plan runs whole (:func:`whole_call`) in one kernel call with the
        content lambda and the table's reach."""
        if not whole_call(plan):
            return super().forward(plan, q, keys, v, table, shared)
        y, content, kn = _module().layer_forward(*_widened(plan, q, keys, v, table, shared), plan.key_norm)
        y, content, kn = _to(y, q.dtype), _to(content, v.dtype), _to(kn, q.dtype)  # (a 16-bit call's: rounded once)
        return (y if plan.stride == 1 else pool(y, plan.count_include_pad)), content, kn

    def backward(self, plan, gy, q, keys, v, table, shared, content, kn):
        """:meth:`.fused.Tiled.backward`, in one kernel call where :meth:`forward` made one."""
        if not whole_call(plan):
            return super().backward(plan, gy, q, keys, v, table, shared, content, kn)
        if plan.stride == 2:
            gy = pool_backward(gy, q.shape[2], q.shape[3], plan.count_include_pad)
        grads = _module().layer_backward(*_widened(plan, gy, q, keys, v, table, shared, content, kn), plan.key_norm)
        return [_to(g, x.dtype) if g is not None and x is not None else g
                for g, x in zip(grads, (q, keys, v, table, shared))]

    def tiled_forward(self, plan, q, v, table, step, content):
        return forward(q, v, table, step, content, PATHS[plan.tiling[0]])

    def tiled_backward(self, plan, gy, q, v, table, step, content):
        return backward(gy, q, v, table, step, content, PATHS[plan.tiling[0]])
