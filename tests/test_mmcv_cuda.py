"""mmcv's CUDA ops, without a GPU: the CPU-vs-CUDA install decision of tools/install.sh, the ``.nv_fatbin``
check of ``mmcv/_ext*.so``, PreflightHook's refusal of CPU-only ops in front of a CUDA model, and (slow) one
small CUDA kernel compiled with this machine's nvcc and the headers tools/build_mmcv_wheel.sh uses."""
import _det  # noqa: F401  (skips this module without the [det] extra)

# isort: split
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from timm_lambda_mmdet import hooks
from timm_lambda_mmdet.hooks import PreflightHook, check_mmcv_ops_for_device
from timm_lambda_mmdet.mmcv_cuda import (
    DEFAULT_CUDA_ARCHS,
    decide_mmcv_build,
    elf_sections,
    has_cuda_device_code,
    mmcv_ext_path,
    mmcv_has_cuda_ops,
    torch_nvidia_include_dirs,
)

REPO = Path(__file__).resolve().parents[1]
CHECK_PY = REPO / 'timm_lambda_mmdet' / 'mmcv_cuda.py'
H100 = [(9, 0)]


# --------------------------------------------------------------------------
# the install decision (tools/install.sh runs `mmcv_cuda.py decide`)
# --------------------------------------------------------------------------
@pytest.mark.parametrize('switch, torch_cuda, gpus, nvcc, ci, want', [
    ('', '13.0', H100, True, False, (True, '9.0')),           # a GPU machine with the toolkit: CUDA ops
    ('auto', '13.0', [(8, 6), (8, 0), (8, 6)], True, False, (True, '8.0;8.6')),
    ('', '13.0', [], True, False, (False, '')),               # this project's machine: no GPU -> CPU ops
    ('', '13.0', H100, True, True, (False, '')),              # CI keeps the prebuilt CPU wheel
    ('', '13.0', H100, False, False, (False, '')),            # no nvcc: CPU ops (and it says why)
    ('', None, [], False, False, (False, '')),                # CPU torch
    ('0', '13.0', H100, True, False, (False, '')),            # forced CPU
    ('1', '13.0', [], True, True, (True, DEFAULT_CUDA_ARCHS)),  # forced CUDA, even in CI, default archs
    ('1', '13.0', H100, False, False, (True, '9.0')),          # forced: the build script names what is missing
])
def test_decide_mmcv_build(switch, torch_cuda, gpus, nvcc, ci, want):
    cuda, archs, reason = decide_mmcv_build(switch, torch_cuda, gpus, nvcc, ci)
    assert (cuda, archs) == want, reason
    assert reason


def test_decide_arch_list_from_the_environment_wins():
    assert decide_mmcv_build('1', '13.0', H100, True, False, '8.9')[:2] == (True, '8.9')


def test_decide_reads_the_switch_as_every_timm_lambda_variable():
    """Any case, the true/false words (issue 39: ``AUTO`` and ``yes`` were refused or read apart)."""
    for switch in ('YES', 'true', 'On'):
        assert decide_mmcv_build(switch, '13.0', [], True, False)[0] is True
    for switch in ('No', 'false', 'OFF'):
        assert decide_mmcv_build(switch, '13.0', H100, True, False)[0] is False
    assert decide_mmcv_build('AUTO', '13.0', H100, True, False)[0] is True


@pytest.mark.parametrize('switch, torch_cuda', [('maybe', '13.0'), ('2', '13.0'), ('1', None)])
def test_decide_refuses(switch, torch_cuda):
    with pytest.raises(ValueError, match='TIMM_LAMBDA_MMCV_CUDA'):
        decide_mmcv_build(switch, torch_cuda, [], True, False)


def test_decide_script_on_this_machine(tmp_path):
    """The shell interface: `python mmcv_cuda.py decide`, as tools/install.sh runs it (CI=true: CPU ops, whatever the
    machine has), and from standard input (the parser then found through the installed package)."""
    env = {k: v for k, v in os.environ.items() if k not in ('TIMM_LAMBDA_MMCV_CUDA', 'TORCH_CUDA_ARCH_LIST')}
    out = subprocess.run([sys.executable, str(CHECK_PY), 'decide'], capture_output=True, text=True,
                         cwd=tmp_path, env={**env, 'CI': 'true'}, check=True).stdout
    assert out.splitlines()[:2] == ['cuda=0', 'archs='] and out.splitlines()[3] == 'switch=auto', out
    off = subprocess.run([sys.executable, '-', 'decide'], stdin=CHECK_PY.open(), capture_output=True, text=True,
                         cwd=tmp_path, env={**env, 'TIMM_LAMBDA_MMCV_CUDA': 'Off'}, check=True).stdout
    assert off.splitlines()[3] == 'switch=0', off  # tools/install.sh reads it to want CPU-only ops
    forced = subprocess.run([sys.executable, '-', 'decide'], stdin=CHECK_PY.open(), capture_output=True, text=True,
                            cwd=tmp_path, env={**env, 'TIMM_LAMBDA_MMCV_CUDA': '1'})
    if torch.version.cuda:
        assert forced.stdout.startswith('cuda=1\narchs='), forced.stdout
    else:
        assert forced.returncode == 1 and 'torch has no CUDA' in forced.stdout


# --------------------------------------------------------------------------
# the ops check: CUDA device code in mmcv/_ext*.so
# --------------------------------------------------------------------------
def test_elf_sections_of_the_installed_mmcv_ops():
    path = mmcv_ext_path()
    assert path and os.path.isfile(path), 'mmcv/_ext*.so not found (mmcv with compiled ops is installed: _det)'
    sections = elf_sections(path)
    assert '.text' in sections and '.dynsym' in sections, sorted(sections)
    assert mmcv_has_cuda_ops() == has_cuda_device_code(path) == ('.nv_fatbin' in sections)
    if shutil.which('objdump'):  # cross-check the section table against binutils where it is installed
        listed = subprocess.run(['objdump', '-h', path], capture_output=True, text=True, check=True).stdout
        assert ('.nv_fatbin' in listed) == ('.nv_fatbin' in sections)


def test_elf_check_refuses_a_non_elf_file(tmp_path):
    (tmp_path / 'x.so').write_bytes(b'not an ELF file' * 8)
    with pytest.raises(ValueError, match='not a 64-bit'):
        has_cuda_device_code(str(tmp_path / 'x.so'))


# --------------------------------------------------------------------------
# PreflightHook: CPU-only mmcv ops in front of a CUDA model
# --------------------------------------------------------------------------
def test_cpu_only_ops_refused_on_cuda():
    with pytest.raises(RuntimeError, match='TIMM_LAMBDA_MMCV_CUDA=1 bash tools/install.sh'):
        check_mmcv_ops_for_device('cuda', False)
    check_mmcv_ops_for_device('cuda', True)
    check_mmcv_ops_for_device('cpu', False)
    check_mmcv_ops_for_device('cpu', True)


class _FakeModel:
    """Stands for a model on ``device`` (no GPU needed: only ``parameters()`` is read)."""

    def __init__(self, device):
        self.device = torch.device(device)

    def parameters(self):
        yield SimpleNamespace(device=self.device)


@pytest.mark.parametrize('device, has_cuda, raises', [
    ('cuda', False, True), ('cuda', True, False), ('cpu', False, False)])
def test_preflight_hook_checks_mmcv_ops(monkeypatch, device, has_cuda, raises):
    calls = []
    real = hooks.check_mmcv_ops_for_device
    monkeypatch.setattr(hooks, 'check_mmcv_ops_for_device', lambda *a: (calls.append(a), real(*a)))
    monkeypatch.setattr(hooks, 'mmcv_has_cuda_ops', lambda: has_cuda)
    runner = SimpleNamespace(model=_FakeModel(device), work_dir='.')
    if raises:
        with pytest.raises(RuntimeError, match='CPU-only compiled ops'):
            PreflightHook().before_run(runner)
    else:
        PreflightHook().before_run(runner)
    assert calls == ([(device, has_cuda)] if device == 'cuda' else [])


# --------------------------------------------------------------------------
# (slow) nvcc compiles a kernel against torch's CUDA headers, as the mmcv CUDA build does
# --------------------------------------------------------------------------
KERNEL = r'''
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

__global__ void axpy_kernel(int n, float a, const float* x, float* y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}

void axpy(float a, const at::Tensor& x, at::Tensor& y) {
  at::cuda::CUDAGuard guard(x.device());
  int n = x.numel();
  axpy_kernel<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      n, a, x.data_ptr<float>(), y.data_ptr<float>());
}
'''


def _nvcc():
    for home in (os.environ.get('CUDA_HOME'), '/usr/local/cuda', *sorted(Path('/usr/local').glob('cuda-*'),
                                                                          reverse=True)):
        if home and os.access(os.path.join(home, 'bin', 'nvcc'), os.X_OK):
            return os.path.join(home, 'bin', 'nvcc')
    return shutil.which('nvcc')


@pytest.mark.slow
def test_nvcc_compiles_an_sm90_kernel_against_torch_headers(tmp_path):
    """~30 s CPU (about a minute of wall time on 2 shared cores): the headers are torch's (ATen/cuda/
    CUDAContext.h pulls in cusparse.h, which a minimal toolkit lacks and torch's nvidia/*/include provide), the
    flags those of torch's cpp_extension for mmcv's .cu files, and the object must hold device code."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip('nvcc not found (CUDA_HOME, /usr/local/cuda*, PATH): no CUDA toolkit to compile with')
    if not torch.version.cuda:
        pytest.skip('torch has no CUDA (torch.version.cuda is None): its CUDA headers are not installed')
    from torch.utils.cpp_extension import include_paths
    (tmp_path / 'axpy.cu').write_text(KERNEL)
    cuda_home = str(Path(nvcc).resolve().parents[1])
    env = dict(os.environ, CPATH=':'.join(
        [os.path.join(cuda_home, 'include'), *torch_nvidia_include_dirs(), *filter(None, [os.environ.get('CPATH')])]))
    cmd = [nvcc, '-c', 'axpy.cu', '-o', 'axpy.o', '-std=c++20', '-Xcompiler', '-fPIC', '--expt-relaxed-constexpr',
           '-gencode', 'arch=compute_90,code=sm_90', '-D__CUDA_NO_HALF_OPERATORS__', '-D__CUDA_NO_HALF_CONVERSIONS__',
           '-D__CUDA_NO_BFLOAT16_CONVERSIONS__', '-D__CUDA_NO_HALF2_OPERATORS__',
           *[f'-I{d}' for d in include_paths(device_type='cuda')]]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f'{" ".join(cmd)}\nCPATH={env["CPATH"]}\n{proc.stdout}\n{proc.stderr[-4000:]}'
    obj = str(tmp_path / 'axpy.o')
    assert has_cuda_device_code(obj), f'no .nv_fatbin in the object: {sorted(elf_sections(obj))}'
    # the fatbin records each cubin's ptxas options (host symbols such as nv::target::sm_90 would not do)
    assert b'-arch sm_90' in (tmp_path / 'axpy.o').read_bytes(), 'the fatbin holds no sm_90 cubin'
    print(f'nvcc compile: {time.monotonic() - t0:.0f} s')
