"""Does mmcv have CUDA ops, and should ``tools/install.sh`` build them?  Standard library only, no GPU needed.

mmcv's compiled ops live in one shared object, ``mmcv/_ext*.so``. A build with ``FORCE_CUDA=1`` links nvcc's
device code into it, in an ELF section named ``.nv_fatbin`` (the cubins of every ``TORCH_CUDA_ARCH_LIST``
entry); a CPU-only build (``FORCE_CUDA=0``) has no such section. Reading the section table needs neither a GPU
nor ``cuobjdump``/``objdump``, so the check works on any machine: ``tools/install.sh`` (before the package is
installed: it runs this file as a script), :class:`timm_lambda_mmdet.hooks.PreflightHook` (before a run) and
the tests use it.

``python timm_lambda_mmdet/mmcv_cuda.py has-cuda-ops [PATH]``: exit 0 when PATH (default: the installed
``mmcv/_ext*.so``) holds CUDA device code, 1 when it does not, 2 when there is no such file.
``python timm_lambda_mmdet/mmcv_cuda.py decide``: print the install decision (see :func:`decide_mmcv_build`) as
``cuda=0|1 archs=... reason=... switch=0|1|auto`` lines for the shell (``switch``: ``$TIMM_LAMBDA_MMCV_CUDA`` read
by :func:`read_switch`).
``python timm_lambda_mmdet/mmcv_cuda.py nvidia-include-dirs``: the ``nvidia/*/include`` directories of torch's pip
dependencies, ``:``-separated (for ``CPATH``).
"""
import os
import struct
import sys
from typing import Dict, Iterable, Optional, Sequence, Tuple

__all__ = ['CUDA_SECTION', 'DEFAULT_CUDA_ARCHS', 'elf_sections', 'has_cuda_device_code', 'mmcv_ext_path',
           'mmcv_has_cuda_ops', 'decide_mmcv_build', 'read_switch', 'torch_nvidia_include_dirs']

CUDA_SECTION = '.nv_fatbin'
# Ampere (A100 8.0, RTX 30xx 8.6), Ada (RTX 40xx / L4 / L40 8.9), Hopper (H100/H200 9.0); the PTX of 9.0 lets
# newer GPUs (Blackwell) JIT-compile the kernels. CUDA 13 has no targets below 7.5. Each arch adds compile time.
DEFAULT_CUDA_ARCHS = '8.0;8.6;8.9;9.0+PTX'


def _env():
    """``timm_lambda/_env.py``, the package's parser of its variables, loaded by its file: the one beside this
    package's folder (tools/install.sh runs this file as a script before the package is installed), else an installed
    one."""
    import importlib.util
    here = globals().get('__file__')
    path = ''
    if here and os.path.isfile(here):
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(here))), 'timm_lambda', '_env.py')
    if not os.path.isfile(path):  # (read from standard input)
        spec = importlib.util.find_spec('timm_lambda')
        path = os.path.join(os.path.dirname(spec.origin), '_env.py') if spec and spec.origin else path
    spec = importlib.util.spec_from_file_location('_timm_lambda_env', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_switch(switch: Optional[str]) -> str:
    """``$TIMM_LAMBDA_MMCV_CUDA`` (``switch``) as ``'0'``, ``'1'`` or ``'auto'``, by the package's parser: auto,
    1/true/yes/on or 0/false/no/off in any case, unset or empty meaning auto; anything else a ValueError naming the
    variable and its values."""
    env = _env()
    kind, default, choices, _ = env.VARIABLES['TIMM_LAMBDA_MMCV_CUDA']
    return env.parse_choice('TIMM_LAMBDA_MMCV_CUDA', switch, choices, default)


def elf_sections(path: str) -> Dict[str, int]:
    """``{section name: size}`` of a 64-bit little-endian ELF file (what ``objdump -h`` lists)."""
    with open(path, 'rb') as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b'\x7fELF' or head[4] != 2 or head[5] != 1:
            raise ValueError(f'{path} is not a 64-bit little-endian ELF file')
        e_shoff, = struct.unpack_from('<Q', head, 0x28)
        e_shentsize, e_shnum, e_shstrndx = struct.unpack_from('<HHH', head, 0x3A)
        if e_shoff == 0 or e_shnum == 0:
            return {}
        f.seek(e_shoff)
        table = f.read(e_shentsize * e_shnum)
        headers = [struct.unpack_from('<IIQQQQ', table, i * e_shentsize) for i in range(e_shnum)]
        # (sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size)
        _, _, _, _, str_off, str_size = headers[e_shstrndx]
        f.seek(str_off)
        names = f.read(str_size)
    out = {}
    for sh_name, _, _, _, _, sh_size in headers:
        end = names.find(b'\0', sh_name)
        out[names[sh_name:end].decode('ascii', 'replace')] = sh_size
    return out


def has_cuda_device_code(path: str) -> bool:
    """True if the ELF file (a .so or an nvcc object) embeds CUDA device code (a non-empty ``.nv_fatbin``)."""
    return elf_sections(path).get(CUDA_SECTION, 0) > 0


def mmcv_ext_path() -> Optional[str]:
    """The installed ``mmcv/_ext*.so`` (found without importing mmcv), or None."""
    import importlib.metadata as md
    try:
        files = md.distribution('mmcv').files or []
    except md.PackageNotFoundError:
        return None
    for f in files:
        if f.parts[:1] == ('mmcv',) and f.name.startswith('_ext.') and f.name.endswith('.so'):
            return str(f.locate())
    return None


def mmcv_has_cuda_ops(path: Optional[str] = None) -> bool:
    """True if mmcv's compiled ops (``path``, default the installed ``mmcv/_ext*.so``) include CUDA kernels."""
    path = path or mmcv_ext_path()
    return bool(path) and os.path.isfile(path) and has_cuda_device_code(path)


def decide_mmcv_build(switch: str, torch_cuda: Optional[str], gpu_capabilities: Sequence[Tuple[int, int]],
                      have_nvcc: bool, ci: bool, arch_list: str = '') -> Tuple[bool, str, str]:
    """Whether tools/install.sh wants mmcv with CUDA ops: ``(cuda, TORCH_CUDA_ARCH_LIST, reason)``.

    * ``switch`` is ``$TIMM_LAMBDA_MMCV_CUDA`` (:func:`read_switch`): off (``0``) CPU ops only, on (``1``) CUDA
      ops (errors follow in the build if the toolkit is missing), ``''``/``'auto'`` decide here;
    * auto: CUDA ops when torch has CUDA (``torch.version.cuda``), a GPU is visible and nvcc is found, and not in
      CI (``$CI`` set: CI keeps the prebuilt CPU wheel from PIP_FIND_LINKS). A CUDA torch with nvcc but no
      visible GPU (a build host, this project's development machine) gets CPU ops: an unrequested 18+ minute
      build for a device that is not there is not worth it; ``TIMM_LAMBDA_MMCV_CUDA=1`` asks for it;
    * the arch list: ``arch_list`` (a user's ``$TORCH_CUDA_ARCH_LIST``) if set, else the visible GPUs'
      capabilities, else :data:`DEFAULT_CUDA_ARCHS`.
    """
    switch = read_switch(switch)
    if arch_list.strip():
        archs, where = arch_list.strip(), 'from $TORCH_CUDA_ARCH_LIST'
    elif gpu_capabilities:
        archs = ';'.join(sorted({f'{major}.{minor}' for major, minor in gpu_capabilities}))
        where = 'of the visible GPU(s)'
    else:
        archs, where = DEFAULT_CUDA_ARCHS, 'the default (no GPU visible)'
    if switch == '0':
        return False, '', 'TIMM_LAMBDA_MMCV_CUDA=0'
    if switch == '1':
        if not torch_cuda:
            raise ValueError('TIMM_LAMBDA_MMCV_CUDA=1, but the installed torch has no CUDA (torch.version.cuda is '
                             'None): install a CUDA build of torch first')
        return True, archs, f'TIMM_LAMBDA_MMCV_CUDA=1; archs {archs} {where}'
    if ci:
        return False, '', 'CI is set: CPU ops (the prebuilt wheel); TIMM_LAMBDA_MMCV_CUDA=1 to build CUDA ops'
    if not torch_cuda:
        return False, '', 'torch has no CUDA'
    if not gpu_capabilities:
        return False, '', ('no GPU visible (torch.cuda.device_count() == 0): CPU ops; TIMM_LAMBDA_MMCV_CUDA=1 '
                           f'builds CUDA ops for {archs}')
    if not have_nvcc:
        return False, '', ('a GPU is visible but no nvcc was found (CUDA_HOME, /usr/local/cuda*, PATH): CPU ops; '
                           f'install the CUDA {torch_cuda} toolkit and rerun for CUDA ops')
    return True, archs, f'torch CUDA {torch_cuda}, GPU(s) visible, nvcc found; archs {archs} {where}'


def torch_nvidia_include_dirs() -> list:
    """``site-packages/nvidia/*/include`` of torch's pip CUDA dependencies (``nvidia/cu13/include``, ...)."""
    import glob
    import importlib.util
    spec = importlib.util.find_spec('nvidia')
    roots = list(spec.submodule_search_locations or []) if spec else []
    return sorted(d for root in roots for d in glob.glob(os.path.join(root, '*', 'include')) if os.path.isdir(d))


def _find_nvcc(env: Dict[str, str]) -> Optional[str]:
    import glob
    import shutil
    for home in (env.get('CUDA_HOME'), env.get('CUDA_PATH'), '/usr/local/cuda',
                 *sorted(glob.glob('/usr/local/cuda-*'), reverse=True)):
        if home and os.access(os.path.join(home, 'bin', 'nvcc'), os.X_OK):
            return os.path.join(home, 'bin', 'nvcc')
    return shutil.which('nvcc')


def _main(argv: Iterable[str]) -> int:
    argv = list(argv)
    if argv[:1] == ['has-cuda-ops']:
        path = argv[1] if len(argv) > 1 else mmcv_ext_path()
        if not path or not os.path.isfile(path):
            print('no mmcv/_ext*.so', file=sys.stderr)
            return 2
        return 0 if has_cuda_device_code(path) else 1
    if argv[:1] == ['nvidia-include-dirs']:
        print(':'.join(torch_nvidia_include_dirs()))
        return 0
    if argv[:1] == ['decide']:
        import torch
        caps = []
        if torch.version.cuda and torch.cuda.is_available():
            caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        env = dict(os.environ)
        try:
            cuda, archs, reason = decide_mmcv_build(
                env.get('TIMM_LAMBDA_MMCV_CUDA', ''), torch.version.cuda, caps, _find_nvcc(env) is not None,
                bool(env.get('CI')), env.get('TORCH_CUDA_ARCH_LIST', ''))
        except ValueError as e:
            print(f'error={e}')
            return 1
        print(f'cuda={int(cuda)}\narchs={archs}\nreason={reason}\nswitch={read_switch(env.get("TIMM_LAMBDA_MMCV_CUDA"))}')
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == '__main__':
    sys.exit(_main(sys.argv[1:]))
