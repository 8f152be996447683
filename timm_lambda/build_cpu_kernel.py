"""``python -m timm_lambda.build_cpu_kernel``: build the tiled form's C++ CPU kernel for this machine's CPU, torch and
Python into torch's extension cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), once, at
install: the layers only load it and never compile inside a training step (docs/install.md, "The tiled form's CPU
kernel"). ``tools/install.sh`` runs it. ``TIMM_LAMBDA_CPU_ARCH`` (default ``native``) names another ``-march=``
target, built (and loaded) separately: e.g. ``x86-64-v3`` for AVX2 + FMA CPUs. It prints where the build is, how
long it took and whether the bfloat16 kernels (AVX-512 BF16) were built; exit status 1 where the build fails (the
cause and remedy first): the models then run the GEMM path, correct and about half as fast.

Run with the environment's own python (``-m``, not a script on PATH): the build is for that python's torch."""
import argparse
import logging
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog='python -m timm_lambda.build_cpu_kernel',
        description="Build the tiled form's C++ CPU kernel for this CPU, torch and Python (about 40 s on 2 cores; "
                    "nothing to do where it is built), and remove the builds it supersedes.")
    parser.add_argument('--verbose', action='store_true', help="show torch's build output (the compiler commands)")
    args = parser.parse_args(argv)

    from .layers.position_lambda import cpu_kernel
    logger = logging.getLogger(cpu_kernel.__name__)  # its lines: "building ... into", "removed older builds"
    logger.setLevel(logging.INFO)
    logger.addHandler(logging.StreamHandler(sys.stdout))
    t0 = time.perf_counter()
    try:
        kernel = cpu_kernel.build(verbose=args.verbose)
    except cpu_kernel.CpuKernelBuildError as e:
        print(f'timm_lambda: {e}', file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t0
    if kernel.bf16:
        bf16 = 'built (bfloat16 runs in bfloat16)'
    elif cpu_kernel.arch() != 'native':
        bf16 = f'not built: the target -march={cpu_kernel.arch()} has no AVX-512 BF16; bfloat16 runs in float32'
    elif 'avx512_bf16' in cpu_kernel._cpu_flags().split():
        bf16 = ("not built: the compiler does not target the CPU's AVX-512 BF16 (g++ >= 10 does); bfloat16 runs in "
                'float32')
    else:
        bf16 = 'not built, no AVX-512 BF16 on this CPU (bfloat16 runs in float32 at stride 1)'
    done = 'is built' if cpu_kernel._compiled else 'was already built'
    print(f"timm_lambda: the tiled form's CPU kernel {done}: {kernel.__file__} ({seconds:.1f} s); its bfloat16 "
          f'kernels: {bf16}; its instruction set: {cpu_kernel.ISA_NAMES[cpu_kernel.isa()]} '
          f'({kernel.vector_bytes}-byte vectors, -march={cpu_kernel.arch()})')
    return 0


if __name__ == '__main__':
    sys.exit(main())
