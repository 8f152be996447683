"""The messages of issue 39: each names the cause and the remedy in its first line (the CPU kernel's build: a
read-only extension cache, no compiler, a failed build, and the one line before a first build; at run time without
a build, the command that builds it: issue 38). The global-scope
model's size error: tests/test_models.py; the switches' errors: tests/test_env.py."""
import errno
import logging
import os
import platform
import types
import warnings

import pytest

from _kernel_op import kernel_call
from timm_lambda.layers import execution
from timm_lambda.layers.position_lambda import cpu_kernel


@pytest.fixture
def build(monkeypatch, tmp_path):
    """Run ``cpu_kernel.build`` with ``cpp_extension.load`` replaced by ``load``, on an empty extension cache and a
    fresh lookup; what it returns, or its error's first line."""
    from torch.utils import cpp_extension
    fresh_state(monkeypatch)
    monkeypatch.setenv('TORCH_EXTENSIONS_DIR', str(tmp_path))

    def run(load):
        monkeypatch.setattr(cpp_extension, 'load', load)
        try:
            return cpu_kernel.build(), None
        except cpu_kernel.CpuKernelBuildError as e:
            assert cpu_kernel.unavailable() == str(e).splitlines()[0]  # what the dispatch and its warning say
            return None, str(e).splitlines()[0]
    return run


def fresh_state(monkeypatch):
    """A process that has not looked the kernel up, nor warned."""
    monkeypatch.setattr(execution, '_WARNED', set())
    for name, value in dict(_kernel=None, _reason=None, _failed=None, _looked_up=False).items():
        monkeypatch.setattr(cpu_kernel, name, value)


def _raise(e):
    def load(*args, **kwargs):
        raise e
    return load


def test_a_read_only_extension_cache_names_torch_extensions_dir(build):
    e = PermissionError(errno.EACCES, 'Permission denied', '/ro/torch_extensions/lock')
    result, line = build(_raise(e))
    assert result is None
    assert line.startswith("the tiled form's CPU kernel could not be built: its build folder ")
    assert line.endswith('is not writable; set TORCH_EXTENSIONS_DIR to a writable folder (at run time too); the '
                         'position lambdas run as batched GEMMs instead (correct, about half as fast)')


def test_a_read_only_file_system_too(build):
    result, line = build(_raise(OSError(errno.EROFS, 'Read-only file system')))
    assert 'set TORCH_EXTENSIONS_DIR to a writable folder' in line


def test_no_compiler_is_said_before_torch_tries(build, monkeypatch):
    monkeypatch.setenv('CXX', 'no-such-compiler-39')
    result, line = build(_raise(AssertionError('torch must not be asked to build')))
    assert result is None
    assert line == ("the tiled form's CPU kernel was not built: no C++ compiler ('no-such-compiler-39', $CXX or c++ "
                    "on PATH); install one with OpenMP, e.g. g++; the position lambdas run as batched GEMMs instead "
                    "(correct, about half as fast)")


def test_a_failed_build_puts_the_remedy_before_torchs_output(build, monkeypatch):
    monkeypatch.setenv('CXX', 'sh')  # a program that exists: the build is tried
    banner = '\n'.join(['!! WARNING !!'] * 50 + ['fatal error: omp.h: No such file or directory'])
    result, line = build(_raise(RuntimeError(f'Error building extension\n{banner}')))
    assert result is None
    assert line == ("the tiled form's CPU kernel could not be built (RuntimeError): install a C++ compiler with OpenMP "
                    "(g++, or clang++ with libomp) or see its output below; the position lambdas run as batched GEMMs "
                    "instead (correct, about half as fast)")


def _fake_load(built):
    """A ``cpp_extension.load`` that writes an empty library where torch would and returns ``built``."""
    def load(name, sources, build_directory, **kwargs):
        with open(os.path.join(build_directory, name + '.so'), 'wb'):
            pass
        return built
    return load


def test_one_line_before_a_build_and_none_where_it_is_built(build, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv('CXX', 'sh')
    built = types.SimpleNamespace(bf16=False)
    name = cpu_kernel._name()
    with caplog.at_level(logging.INFO, logger=cpu_kernel.__name__):
        assert build(_fake_load(built)) == (built, None)
    assert [r.getMessage() for r in caplog.records] == [
        f"timm_lambda: building the tiled form's CPU kernel (about 40 s on 2 cores) into {tmp_path / name}"]
    caplog.clear()
    fresh_state(monkeypatch)
    monkeypatch.setattr(cpu_kernel, '_import', lambda name, path: built)  # the stamped build: loaded, not compiled
    with caplog.at_level(logging.INFO, logger=cpu_kernel.__name__):
        assert build(_raise(AssertionError('a stamped build is not compiled again'))) == (built, None)
    assert caplog.records == []


def test_no_build_one_warning_naming_the_command(monkeypatch, tmp_path, backend):
    """At run time the kernel is loaded, never compiled: without a build, the gemm backend and one warning naming the
    command that builds it; :func:`unavailable` says the same to the backend table."""
    import sys

    import torch
    from torch.utils import cpp_extension
    fresh_state(monkeypatch)
    monkeypatch.setenv('TORCH_EXTENSIONS_DIR', str(tmp_path))
    monkeypatch.setattr(cpp_extension, 'load', _raise(AssertionError('no build at run time')))
    from timm_lambda.layers import execution
    from timm_lambda.layers.position_lambda import backends
    monkeypatch.setattr(execution, '_WARNED', set())
    q, v, table = torch.randn(1, 2, 3, 5, 6), torch.randn(1, 4, 5, 6), torch.randn(3, 1, 5, 5)
    backend('auto', strict=True)  # strict: auto raises too, naming the cause and the remedy, not the fallback
    with pytest.raises(RuntimeError, match=r"^timm_lambda: strict mode: the cpu_kernel backend of the position "
                                           r"lambdas cannot run the tiled form on cpu in float32 on this machine "
                                           r"\(the tiled form's CPU kernel is not built .* build it once with .*; "
                                           r"raising instead of handing the call to the next backend"):
        kernel_call(q, v, table, 1)
    backend('auto', strict=False)
    backends.served_backends(reset=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for dtype in (torch.float32, torch.float64):
            kernel_call(q.to(dtype), v.to(dtype), table.to(dtype), 1)
    assert {k[1] for k in backends.served_backends()} == {'gemm'}
    lines = [str(w.message) for w in caught if w.category is RuntimeWarning]
    reason = cpu_kernel.unavailable()
    assert lines == [f'timm_lambda: {reason} (docs/execution_modes.md)']
    assert reason == (
        f"the tiled form's CPU kernel is not built for this CPU, torch {torch.__version__} and Python "
        f"{platform.python_version()} (in {tmp_path / cpu_kernel._name()}): build it once with `{sys.executable} -m "
        f"timm_lambda.build_cpu_kernel` (tools/install.sh runs it; about 40 s on 2 cores); the position lambdas run "
        f"as batched GEMMs instead (correct, about half as fast); TIMM_LAMBDA_BACKEND=gemm chooses them without this "
        f"warning")


def test_torchrun_without_a_gpu_names_the_cpu_ddp_config(monkeypatch, tmp_path):
    """``torchrun -m timm_lambda_mmdet train CONFIG --launcher pytorch`` on a machine without an accelerator: a config
    that does not import ``timm_lambda_mmdet.cpu_distributed`` stops before mmdet's train.py, naming the _cpu-ddp
    config (mmengine would stop at 'Found no NVIDIA driver'); the _cpu-ddp config, another launcher, or a GPU run
    mmdet's script."""
    import os.path as osp

    import torch

    import _det  # noqa: F401  (skips without the [det] extra)
    from _mmdet_helpers import CONFIG_DIR
    from timm_lambda_mmdet import __main__ as cli

    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    ran = []
    script = tmp_path / 'train.py'
    script.write_text('import sys; RAN.append(sys.argv[1:])\n')
    monkeypatch.setattr(cli, 'mmdet_script', lambda name: str(script))
    monkeypatch.setattr(cli.runpy, 'run_path', lambda path, run_name: ran.append(path))
    gpu_config = osp.join(CONFIG_DIR, 'mask-rcnn_lambdaresnet101_fpn_syncbn_lsj-130k_coco.py')
    with pytest.raises(SystemExit) as e:
        cli.main(['train', gpu_config, '--launcher', 'pytorch'])
    assert str(e.value).startswith('timm_lambda_mmdet: --launcher pytorch on a machine without a GPU needs a CPU '
                                   'config: use the _cpu-ddp one (configs/mmdet/mask-rcnn_lambdaresnet101_fpn_syncbn_'
                                   'lsj-130k_coco_cpu-ddp.py)')
    with pytest.raises(SystemExit):
        cli.main(['train', gpu_config, '--launcher=pytorch'])
    assert ran == []
    cli.main(['train', gpu_config.replace('_coco.py', '_coco_cpu-ddp.py'), '--launcher', 'pytorch'])
    cli.main(['train', gpu_config])  # no launcher: one process, no process group
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    cli.main(['train', gpu_config, '--launcher', 'pytorch'])
    assert ran == [str(script)] * 3


def test_a_bug_in_the_build_propagates_not_a_build_error(build):
    """Only what a failed build raises (OSError, ImportError, a subprocess's error, cpp_extension's RuntimeError)
    becomes a CpuKernelBuildError and the GEMM fallback: any other exception is a bug and propagates as it is."""
    import subprocess
    with pytest.raises(TypeError, match='a bug'):
        build(_raise(TypeError('a bug')))
    assert build(_raise(subprocess.CalledProcessError(1, ['ninja'])))[1].startswith(
        "the tiled form's CPU kernel could not be built (CalledProcessError)")
