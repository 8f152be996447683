"""Which instruction sets a run's code used, and how to hold the libraries to a smaller one.

A CPU figure depends on three instruction sets: the CPU kernel's build (``cpu_kernel.isa()``, from the build's
compiler macros; ``TIMM_LAMBDA_CPU_ARCH`` picks another ``-march=`` build), ATen's own kernels
(``torch.backends.cpu.get_cpu_capability()``) and oneDNN's convolutions and matmuls (its verbose output names the
implementation, e.g. ``brg_conv_fwd:avx10_1_512_amx`` for a bfloat16 convolution on AMX). :func:`probe` asks a fresh
process with a given environment for all three, so that each result records what ran, not what was meant to.

:data:`HOLD` holds the libraries to the instruction set of a smaller CPU (set before torch loads): ``avx2`` as an
AVX2 + FMA CPU runs them (oneDNN, MKL and ATen; oneDNN then runs bfloat16 convolutions by its reference code, so
bfloat16 is not measured that way), ``avx512_bf16`` as a CPU with AVX-512 BF16 and no AMX (oneDNN only; AMX computes
16-bit types only, so float32 does not change).
"""
import json
import os
import subprocess
import sys
from typing import Dict, Optional

__all__ = ['HOLD', 'probe']

HOLD: Dict[str, Dict[str, str]] = {
    'avx2': dict(ONEDNN_MAX_CPU_ISA='AVX2', DNNL_MAX_CPU_ISA='AVX2', MKL_ENABLE_INSTRUCTIONS='AVX2',
                 ATEN_CPU_CAPABILITY='avx2', MKL_DEBUG_CPU_TYPE='5'),
    'avx512_bf16': dict(ONEDNN_MAX_CPU_ISA='AVX512_CORE_BF16', DNNL_MAX_CPU_ISA='AVX512_CORE_BF16'),
}

_PROBE = r'''
import json, torch
from timm_lambda.layers.position_lambda import cpu_kernel
x, conv = torch.randn(1, 64, 32, 32), torch.nn.Conv2d(64, 64, 3, padding=1)
with torch.no_grad():
    conv(x)
    with torch.autocast('cpu', torch.bfloat16):
        conv(x)
print('PROBE ' + json.dumps(dict(kernel_isa=cpu_kernel.isa(), kernel_arch=cpu_kernel.arch(),
                                 aten_capability=torch.backends.cpu.get_cpu_capability())))
'''


def probe(env: Optional[Dict[str, str]] = None) -> dict:
    """In a process with ``env`` added: the CPU kernel's instruction set and ``-march=`` target, ATen's capability,
    oneDNN's instruction set and the implementations of a float32 and a bfloat16 (autocast) 3x3 convolution
    (``None`` where oneDNN did not run it)."""
    out = subprocess.run([sys.executable, '-c', _PROBE], env=dict(os.environ, **(env or {}), ONEDNN_VERBOSE='1'),
                         capture_output=True, text=True, check=True).stdout
    found = {}
    convs = {}
    for line in out.splitlines():
        if line.startswith('PROBE '):
            found.update(json.loads(line[len('PROBE '):]))
        elif ',info,cpu,isa:' in line:
            found['onednn_isa'] = line.split(',info,cpu,isa:', 1)[1]
        elif ',exec,cpu,convolution,' in line:
            impl, _, rest = line.split(',exec,cpu,convolution,', 1)[1].partition(',')
            dtype = 'bfloat16' if 'src:bf16' in rest else 'float32'
            convs.setdefault(dtype, impl)
    found['conv_float32'], found['conv_bfloat16'] = convs.get('float32'), convs.get('bfloat16')
    return found
