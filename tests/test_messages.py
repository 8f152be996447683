"""The messages of issue 39: each names the cause and the remedy in its first line (the CPU kernel's build: a
read-only extension cache, no compiler, a failed build, and the one line before a first build). The global-scope
model's size error: tests/test_models.py; the switches' errors: tests/test_env.py."""
import errno
import logging
import warnings

import pytest

from timm_lambda.layers.position_lambda import cpu_kernel, execution


@pytest.fixture
def build(monkeypatch, tmp_path):
    """Run ``cpu_kernel._build`` (uncached) with ``cpp_extension.load`` replaced by ``load``; its warnings' first
    lines and its log records."""
    from torch.utils import cpp_extension
    monkeypatch.setattr(execution, '_WARNED', set())
    monkeypatch.setenv('TORCH_EXTENSIONS_DIR', str(tmp_path))

    def run(load, caplog=None):
        monkeypatch.setattr(cpp_extension, 'load', load)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            result = cpu_kernel._build.__wrapped__()
        return result, [str(w.message).splitlines()[0] for w in caught if w.category is RuntimeWarning]
    return run


def _raise(e):
    def load(*args, **kwargs):
        raise e
    return load


def test_a_read_only_extension_cache_names_torch_extensions_dir(build):
    e = PermissionError(errno.EACCES, 'Permission denied', '/ro/torch_extensions/lock')
    result, lines = build(_raise(e))
    assert result is None and len(lines) == 1
    assert lines[0].startswith("timm_lambda: the tiled form's CPU kernel could not be built: its build folder ")
    assert 'is not writable; set TORCH_EXTENSIONS_DIR to a writable folder (TIMM_LAMBDA_CPU_KERNEL=0 skips the ' \
           'build); the position lambdas run as batched GEMMs instead' in lines[0]


def test_a_read_only_file_system_too(build):
    result, lines = build(_raise(OSError(errno.EROFS, 'Read-only file system')))
    assert 'set TORCH_EXTENSIONS_DIR to a writable folder' in lines[0]


def test_no_compiler_is_said_before_torch_tries(build, monkeypatch):
    monkeypatch.setenv('CXX', 'no-such-compiler-39')
    result, lines = build(_raise(AssertionError('torch must not be asked to build')))
    assert result is None
    assert lines == ["timm_lambda: the tiled form's CPU kernel was not built: no C++ compiler ('no-such-compiler-39', "
                     "$CXX or c++ on PATH); install one with OpenMP, e.g. g++ (TIMM_LAMBDA_CPU_KERNEL=0 skips the "
                     "build); the position lambdas run as batched GEMMs instead (correct, about half as fast) "
                     "(docs/execution_modes.md)"]


def test_a_failed_build_puts_the_remedy_before_torchs_output(build, monkeypatch):
    monkeypatch.setenv('CXX', 'sh')  # a program that exists: the build is tried
    banner = '\n'.join(['!! WARNING !!'] * 50 + ['fatal error: omp.h: No such file or directory'])
    result, lines = build(_raise(RuntimeError(f'Error building extension\n{banner}')))
    assert result is None
    assert lines == ["timm_lambda: the tiled form's CPU kernel could not be built (RuntimeError): install a C++ "
                     "compiler with OpenMP (g++, or clang++ with libomp) or see its output below "
                     "(TIMM_LAMBDA_CPU_KERNEL=0 skips the build); the position lambdas run as batched GEMMs instead "
                     "(correct, about half as fast)"]


def test_one_line_before_a_first_build_and_none_after(build, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv('CXX', 'sh')
    built = object()
    with caplog.at_level(logging.WARNING, logger=cpu_kernel.__name__):
        assert build(lambda name, *a, **k: built)[0] is built
    assert [r.getMessage() for r in caplog.records] == [
        f"timm_lambda: building the tiled form's CPU kernel, once per CPU and torch version (about 40 s on 2 cores), "
        f"into {tmp_path / ('timm_lambda_tiled_cpu_' + cpu_kernel._machine_tag())}; TIMM_LAMBDA_CPU_KERNEL=0 skips "
        f"the build"]
    caplog.clear()
    name = 'timm_lambda_tiled_cpu_' + cpu_kernel._machine_tag()
    (tmp_path / name / (name + '.so')).write_bytes(b'')  # already built: torch loads it, nothing to say
    with caplog.at_level(logging.WARNING, logger=cpu_kernel.__name__):
        assert build(lambda name, *a, **k: built)[0] is built
    assert caplog.records == []


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
