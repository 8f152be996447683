"""Helpers shared by several test modules (a test module imports none of another's names): error measures, the
switch to the position lambdas' plain-op execution, capability probes and fabricated state dicts."""
import functools
import importlib.util
import inspect
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]


def load_file(path, name: str):
    """The Python file ``path`` (relative to the repository root: a tool under tools/, a stdlib-only copy of a parser)
    loaded as a new module ``name``, each call afresh (so that patching it touches no other test's copy, nor the
    module already imported under its own name)."""
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def require_triton():
    """Skip without Triton, or fail with TIMM_LAMBDA_REQUIRE_TRITON=1 (CI: the interpreted runs are its only run of
    the GPU kernels, and must not skip there)."""
    import pytest

    from timm_lambda._env import env
    try:
        import triton  # noqa: F401
    except ImportError as e:
        if env('TIMM_LAMBDA_REQUIRE_TRITON'):
            pytest.fail(f'TIMM_LAMBDA_REQUIRE_TRITON=1, but Triton does not import ({e}): the GPU kernels go untested')
        pytest.skip('Triton is not installed (it comes with torch on Linux x86-64); TIMM_LAMBDA_REQUIRE_TRITON=1 '
                    'makes this an error')


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference relative to the largest entry of the reference ``b``, in float64."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@functools.lru_cache(maxsize=None)
def dynamo_onnx_export_error() -> Optional[str]:
    """None if torch's dynamo ONNX exporter (``torch.onnx.export(dynamo=True)``) exports a plain Conv + BatchNorm
    here, else why not. tests/test_timm_contract.py skips its dynamo-exporter cases with this reason: the exporter is
    torch's (with onnxscript), and one that cannot export two torch.nn layers says nothing about timm-lambda.
    Seen: torch 2.4 has no ``dynamic_shapes`` (TypeError); torch 2.5.1 and 2.6.0 with onnxscript 0.7.2 fail on the
    BatchNorm (ConversionError; torch 2.6.0 with onnxscript 0.2.5 works); torch 2.14.1 works."""
    if 'dynamic_shapes' not in inspect.signature(torch.onnx.export).parameters:
        return (f'torch {torch.__version__}: torch.onnx.export has no dynamic_shapes '
                '(the dynamo exporter needs torch >= 2.5)')
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter('ignore')
        try:
            torch.onnx.export(model, (torch.randn(1, 3, 8, 8),), str(Path(tmp) / 'bn.onnx'), dynamo=True)
        except Exception as e:  # torch.onnx's ConversionError
            import onnxscript
            return (f'torch {torch.__version__} with onnxscript {onnxscript.__version__}: the dynamo ONNX exporter '
                    f'cannot export a plain Conv + BatchNorm ({type(e).__name__})')
    return None


def dli14_state_dict(seed: int = 0, num_classes: int = 1000, layers=(3, 4, 6, 3)) -> dict:
    """A state_dict of d-li14/lambda.pytorch's ImageNet LambdaResNet-50 (tests/test_peer_weights.py) with their key
    names, order and shapes, filled with random values that keep activations
    O(1) (BN statistics and affine non-trivial; lambda-convolution biases as large as PyTorch's init allows
    x 10, so that a missing bias shows)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}

    def normal(*shape, std):
        return torch.randn(*shape, generator=g) * std

    def uniform(n, lo, hi):
        return torch.rand(n, generator=g) * (hi - lo) + lo

    def conv(name, out_chs, in_chs, k=1):
        sd[name] = normal(out_chs, in_chs, k, k, std=0.7 * (2.0 / (in_chs * k * k)) ** 0.5)

    def bn(prefix, n, gamma=(0.5, 1.0)):
        sd[prefix + 'weight'] = uniform(n, *gamma)
        sd[prefix + 'bias'] = uniform(n, -0.2, 0.2)
        sd[prefix + 'running_mean'] = uniform(n, -0.1, 0.1)
        sd[prefix + 'running_var'] = uniform(n, 0.5, 1.5)
        sd[prefix + 'num_batches_tracked'] = torch.tensor(1000)

    conv('conv1.weight', 64, 3, 7)
    bn('bn1.', 64)
    inplanes, nh, dk, du, r = 64, 4, 16, 1, 23
    for stage, (planes, depth) in enumerate(zip((64, 128, 256, 512), layers), start=1):
        for i in range(depth):
            p = f'layer{stage}.{i}.'
            width, dv = planes, planes // nh
            conv(p + 'conv1.weight', width, inplanes)
            bn(p + 'bn1.', width)
            sd[p + 'conv2.conv_qkv.weight'] = torch.cat([
                normal(nh * dk, width, 1, 1, std=(dk * width) ** -0.5),
                normal(dk * du + dv * du, width, 1, 1, std=width ** -0.5)])
            bn(p + 'conv2.norm_q.', nh * dk)
            bn(p + 'conv2.norm_v.', dv * du)
            sd[p + 'conv2.lambda_conv.weight'] = normal(dk, du, 1, r, r, std=0.02)
            sd[p + 'conv2.lambda_conv.bias'] = uniform(dk, -0.4, 0.4)
            bn(p + 'bn2.', width)
            conv(p + 'conv3.weight', planes * 4, width)
            bn(p + 'bn3.', planes * 4, gamma=(0.2, 0.5))
            if i == 0:
                conv(p + 'downsample.0.weight', planes * 4, inplanes)
                bn(p + 'downsample.1.', planes * 4)
            inplanes = planes * 4
    sd['fc.weight'] = normal(num_classes, 2048, std=0.02)
    sd['fc.bias'] = uniform(num_classes, -0.1, 0.1)
    return sd


def require_cpu_kernel():
    """The CPU kernel must serve. It is built at install (``python -m timm_lambda.build_cpu_kernel``, run by
    tools/install.sh), never at run time. CI sets TIMM_LAMBDA_REQUIRE_CPU_KERNEL=1: there a kernel that is not built
    (or is off) fails the test, never skips it: the install must have built it. Elsewhere a test builds it here (a
    test is no training step) and skips where no C++ compiler can."""
    import pytest

    from timm_lambda._env import env
    from timm_lambda.layers.position_lambda import cpu_kernel
    if cpu_kernel.load() is not None:
        return
    if env('TIMM_LAMBDA_REQUIRE_CPU_KERNEL'):
        pytest.fail(f'TIMM_LAMBDA_REQUIRE_CPU_KERNEL=1, but the CPU kernel cannot serve: {cpu_kernel.unavailable()}')
    if shutil.which('c++') is None and shutil.which('g++') is None:
        pytest.skip('no C++ compiler: the tiled operator runs its GEMM path')
    cpu_kernel.build()  # raises with the cause where a compiler exists but the build fails
    assert cpu_kernel.unavailable() is None, 'the CPU kernel did not build'
