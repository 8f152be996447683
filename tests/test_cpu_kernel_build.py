"""The CPU kernel's build at install (issue 38 item 2; timm_lambda/layers/position_lambda/cpu_kernel.py,
``python -m timm_lambda.build_cpu_kernel``): two processes building at once on an empty extension cache both succeed
and load the one build; a half-written library and a stale lock are rebuilt over; old builds are pruned, never one
another process is building. The slow tests share ONE real build (about 40 s on 2 cores, more on a loaded machine);
the others replace torch's compile."""
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from timm_lambda.layers import execution
from timm_lambda.layers.position_lambda import cpu_kernel

REPO = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, '-m', 'timm_lambda.build_cpu_kernel']
# a process that only loads (torch's compile replaced by a failure): the loaded library's path, or why none
LOAD = textwrap.dedent('''
    from torch.utils import cpp_extension
    from timm_lambda.layers.position_lambda import cpu_kernel
    def no_compile(*args, **kwargs):
        raise AssertionError('load() compiled')
    cpp_extension.load = no_compile
    kernel = cpu_kernel.load()
    print(kernel.__file__ if kernel is not None else 'None: ' + cpu_kernel.unavailable())
''')


def _env(root) -> dict:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root), PYTHONPATH=str(REPO))
    env.pop('TIMM_LAMBDA_BACKEND', None)
    return env


def _run(args, root) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=REPO, env=_env(root), capture_output=True, text=True, timeout=1200)


def _names(cpu='c0ffee00', env='e0e0e0e0', source='5005ce00') -> str:
    return f'{cpu_kernel._PREFIX}{cpu}_{env}_{source}'


def _old_build(root: Path, name: str, days: float = 0, stamped: bool = True) -> Path:
    """A build folder ``name`` in ``root`` last loaded (or, unstamped, written) ``days`` ago."""
    folder = root / name
    folder.mkdir()
    (folder / (name + '.so')).write_bytes(b'old')
    files = [folder / (name + '.so'), folder]
    if stamped:
        (folder / cpu_kernel._STAMP).write_text('{}')
        files = [folder / cpu_kernel._STAMP]
    when = time.time() - days * 86400
    for path in files:
        os.utime(path, (when, when))
    return folder


def _two_builds(root):
    """Two ``python -m timm_lambda.build_cpu_kernel`` started at once on an empty extension cache ``root`` (but for a
    superseded build of this CPU, torch and Python and another CPU's: the first goes): both processes' results."""
    cpu, env, _ = cpu_kernel._tags()
    _old_build(root, _names(cpu, env))
    _old_build(root, _names('0the0cpu', env))
    procs = [subprocess.Popen(COMMAND, cwd=REPO, env=_env(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=1200) for p in procs]
    return [(p.returncode,) + out for p, out in zip(procs, outs)]


@pytest.mark.slow
def test_two_builds_at_once_then_a_half_written_library_and_a_stale_lock(tmp_path):
    """One real build (the two promises share it: pytest-xdist 3.8 ignores xdist_group on pytest 9.2, so two tests
    would each build). Two processes building at once on an empty cache both succeed: one compiles, the other waits
    for its lock and loads that build, a third loads it without compiling, the superseded build goes and another
    CPU's stays. Then a build killed while linking leaves a library that its stamp does not describe (and older torch
    a lock file that blocks every later build): it is never loaded; the next build relinks it (ninja keeps the
    objects)."""
    root = tmp_path
    results = _two_builds(root)
    for rc, out, err in results:
        assert rc == 0, out + err[-3000:]
    lines = [out.strip().splitlines()[-1] for _, out, _ in results]
    path = str(root / cpu_kernel._name() / (cpu_kernel._name() + '.so'))
    assert sorted(line.startswith(f"timm_lambda: the tiled form's CPU kernel {done}: {path} (")
                  for line in lines for done in ('is built', 'was already built')) == [False, False, True, True]
    assert sum(line.startswith("timm_lambda: the tiled form's CPU kernel is built: ") for line in lines) == 1
    bf16 = 'avx512_bf16' in cpu_kernel._cpu_flags().split()
    assert all(('its bfloat16 kernels: built' in line) == bf16 for line in lines)
    other_cpu = _names('0the0cpu', cpu_kernel._tags()[1])
    assert sorted(p.name for p in root.iterdir()) == sorted([cpu_kernel._name(), other_cpu])
    assert sum('removed 1 older CPU kernel build(s)' in out for _, out, _ in results) == 1
    assert _run([sys.executable, '-c', LOAD], root).stdout.strip() == path

    folder = root / cpu_kernel._name()
    library = folder / (cpu_kernel._name() + '.so')
    library.write_bytes(library.read_bytes()[:len(library.read_bytes()) // 2])
    (folder / 'lock').write_text('')
    out = _run([sys.executable, '-c', LOAD], root).stdout.strip()
    assert out.startswith("None: the tiled form's CPU kernel is not built"), out
    built = _run(COMMAND, root)
    assert built.returncode == 0, built.stdout + built.stderr[-3000:]
    assert f"the tiled form's CPU kernel is built: {library} (" in built.stdout
    assert _run([sys.executable, '-c', LOAD], root).stdout.strip() == str(library)


def test_prune_removes_superseded_and_idle_builds_never_a_locked_one(tmp_path):
    """Pruned: this CPU, torch and Python's builds of another source, any build unloaded for PRUNE_DAYS, and
    unstamped ones (older versions of this package) unwritten as long. Kept: other CPUs' and torches' builds in use
    (a shared cache, e.g. an NFS home), one another process holds the lock of (building it), other files."""
    cpu, env, source = cpu_kernel._tags()
    keep = _names(cpu, env, source)
    superseded = _old_build(tmp_path, _names(cpu, env))
    busy = _old_build(tmp_path, _names(cpu, env, '0b0b0b0b'))
    other_cpu = _old_build(tmp_path, _names('0the0cpu', env, source), days=cpu_kernel.PRUNE_DAYS - 1)
    other_torch = _old_build(tmp_path, _names(cpu, '0torch00', source), days=1)
    idle = _old_build(tmp_path, _names('1dle0cpu', env, source), days=cpu_kernel.PRUNE_DAYS + 1)
    legacy_idle = _old_build(tmp_path, cpu_kernel._PREFIX + '8c9d208648ba', days=cpu_kernel.PRUNE_DAYS + 1,
                             stamped=False)
    legacy_recent = _old_build(tmp_path, cpu_kernel._PREFIX + '0123456789ab', days=2, stamped=False)
    other = _old_build(tmp_path, 'timm_lambda_fma_peak', days=365)
    (tmp_path / keep).mkdir()
    with cpu_kernel._locked(str(busy)):
        removed = cpu_kernel._prune(str(tmp_path), keep)
    assert removed == sorted(p.name for p in (superseded, idle, legacy_idle))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [keep] + [p.name for p in (busy, other_cpu, other_torch, legacy_recent, other)])
    assert cpu_kernel._prune(str(tmp_path), keep) == [busy.name]  # its builder is done


def test_a_build_another_pruner_removed_while_this_one_waited_is_not_counted(monkeypatch, tmp_path):
    """Two processes pruning at once: the second opens a superseded build's lock file, the first removes the build
    and lets go of the lock, then the second locks the deleted file. It must not remove, nor report, that build
    again (CI saw both processes log 'removed 1 older CPU kernel build(s)')."""
    cpu, env, source = cpu_kernel._tags()
    keep = _names(cpu, env, source)
    superseded = _old_build(tmp_path, _names(cpu, env))
    (tmp_path / keep).mkdir()
    flock = cpu_kernel.fcntl.flock

    def other_pruner_first(fd, op):  # the other process's whole prune, between this one's open and flock
        shutil.rmtree(superseded)
        return flock(fd, op)
    monkeypatch.setattr(cpu_kernel.fcntl, 'flock', other_pruner_first)
    assert cpu_kernel._prune(str(tmp_path), keep) == []
    monkeypatch.setattr(cpu_kernel.fcntl, 'flock', flock)
    superseded.mkdir()
    assert cpu_kernel._prune(str(tmp_path), keep) == [superseded.name]  # (the test can see a removal)


def _fresh(monkeypatch, root):
    monkeypatch.setattr(execution, '_WARNED', set())
    for name, value in dict(_kernel=None, _reason=None, _failed=None, _looked_up=False).items():
        monkeypatch.setattr(cpu_kernel, name, value)
    monkeypatch.setenv('TORCH_EXTENSIONS_DIR', str(root))
    monkeypatch.setenv('CXX', 'sh')  # a program that exists: the build is tried


def test_an_unstamped_library_and_a_baton_left_by_a_killed_build_go_before_the_compile(monkeypatch, tmp_path):
    """Older torch locks a build with ``FileBaton``, a file whose existence is the lock (left by a killed build, it
    blocks every later one); ninja keeps an existing library, half written or not. Under this package's lock both
    are leftovers: removed before torch compiles, then the build is stamped."""
    from torch.utils import cpp_extension
    _fresh(monkeypatch, tmp_path)
    monkeypatch.setattr(cpp_extension, 'FileBaton', object, raising=False)
    name = cpu_kernel._name()
    folder = tmp_path / name
    folder.mkdir()
    (folder / 'lock').write_text('')
    (folder / (name + '.so')).write_bytes(b'half')
    seen = []

    def load(name, sources, build_directory, **kwargs):
        seen.append(sorted(os.listdir(build_directory)))
        (Path(build_directory) / (name + '.so')).write_bytes(b'whole')
        return type('Kernel', (), dict(bf16=False))
    monkeypatch.setattr(cpp_extension, 'load', load)
    assert cpu_kernel.build().bf16 is False
    assert seen == [[cpu_kernel._LOCK]]
    assert cpu_kernel.unavailable() is None
    monkeypatch.setattr(cpu_kernel, '_import', lambda name, path: 'loaded')
    assert cpu_kernel._load(str(folder)) == ('loaded', None)  # stamped: complete


def test_the_command_without_a_compiler_fails_naming_the_cause(tmp_path):
    """``python -m timm_lambda.build_cpu_kernel`` where it cannot build: exit status 1 (tools/install.sh then warns
    and goes on), the cause and remedy on stderr's first line, nothing left in the cache."""
    env = dict(_env(tmp_path), CXX='no-such-compiler-38')
    failed = subprocess.run(COMMAND, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1, failed.stdout + failed.stderr[-3000:]
    assert "timm_lambda: the tiled form's CPU kernel was not built: no C++ compiler ('no-such-compiler-38'" in \
        failed.stderr
    assert list(tmp_path.iterdir()) == []
