#!/usr/bin/env python
"""The offline bundle for a GPU machine without a package index (docs/install.md, "Offline / air-gapped GPU machine").

Such a machine (this project's lent H100/H200s; many clusters) has Python, torch, Triton and timm but no mmcv,
mmengine, mmdet or pycocotools, and nothing can be fetched there. ``build`` runs on a connected machine and writes
one folder; ``install`` runs on the GPU machine and installs it with ``pip install --no-index``::

    python tools/gpu_bundle.py build --out gpu_bundle                   # connected machine, stdlib + pip + git
    python3 tools/gpu_bundle.py install --bundle gpu_bundle            # GPU machine, from the checkout

The folder: ``wheels/`` (every wheel the detection and timm checks need that the target image lacks, for the
target's Python and platform, at the versions of constraints.txt; and mmcv with CUDA ops compiled for the target's
torch and GPU architecture), ``timm_scripts/`` (timm's train.py, validate.py and benchmark.py at the pinned timm
version's tag, or an error naming the tag: they are not in timm's wheel or sdist) and ``MANIFEST.json`` (command,
date, target, files and sha256).

mmcv: PyPI has only its sdist and its CUDA ops must match the target torch exactly. ``build`` takes, in order,
``--mmcv-wheel`` (a file or a folder), a folder named ``cp<py>-torch<torch>-cu<cuda>-sm<arch>`` under a
``--find-links`` folder (or ``PIP_FIND_LINKS``; e.g. ``../shared/wheels/cp312-torch2.11.0-cu130-sm90``), or builds
one with tools/build_mmcv_wheel.sh in a scratch virtualenv of the target Python and torch (``--build-mmcv``: about
22 minutes on 2 cores, 3 on 16; the same command runs on the GPU machine itself where it has nvcc, see docs).
"""
import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSTRAINTS = os.path.join(ROOT, 'constraints.txt')

# What the checks import that the GPU image lacks (KINDS.md's package list of this project's GPU machines: torch,
# torchvision, Triton, numpy, scipy, matplotlib, opencv-python-headless, rich, six, tqdm, pyyaml, pillow are there).
# mmcv's and mmengine's opencv-python requirement is met by the image's opencv-python-headless (same cv2 module), so
# every wheel is installed with --no-deps.
PACKAGES = ['mmengine', 'mmdet', 'pycocotools', 'shapely', 'addict', 'yapf', 'platformdirs', 'terminaltables',
            'termcolor', 'timm']
TIMM_SCRIPTS = ['train.py', 'validate.py', 'benchmark.py']
TIMM_GIT = 'https://github.com/huggingface/pytorch-image-models'
PLATFORMS = ['manylinux_2_28_x86_64', 'manylinux_2_27_x86_64', 'manylinux_2_24_x86_64', 'manylinux_2_17_x86_64',
             'manylinux2014_x86_64', 'manylinux1_x86_64']


def pins(path: str = CONSTRAINTS) -> dict:
    """``{name: version}`` of constraints.txt's ``name==version`` lines (names lower-case)."""
    out = {}
    with open(path) as f:
        for line in f:
            m = re.match(r'^([A-Za-z0-9_.\-]+)==([^\s;#]+)', line.strip())
            if m:
                out[m.group(1).lower()] = m.group(2)
    return out


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            h.update(block)
    return h.hexdigest()


def log(msg: str) -> None:
    print(f'[gpu_bundle] {msg}', file=sys.stderr, flush=True)


def mmcv_folder_name(python: str, torch: str, arch: str) -> str:
    """``cp312-torch2.11.0-cu130-sm90`` for Python 3.12, torch 2.11.0+cu130, arch 9.0."""
    version, _, local = torch.partition('+')
    return f"cp{python.replace('.', '')}-torch{version}-{local or 'cpu'}-sm{arch.replace('.', '')}"


def find_mmcv_wheel(python: str, torch: str, arch: str, candidates, version: str):
    """The first ``mmcv-<version>-cp<py>-*.whl`` in ``candidates`` (files, folders, or folders holding a folder
    named by :func:`mmcv_folder_name`), else None."""
    tag = f"cp{python.replace('.', '')}"
    name = f'mmcv-{version}-{tag}-{tag}-linux_x86_64.whl'
    sub = mmcv_folder_name(python, torch, arch)
    for c in candidates:
        for path in (c, os.path.join(c, name), os.path.join(c, sub, name)):
            if os.path.isfile(path) and os.path.basename(path) == name:
                return path
    return None


def download_wheels(out: str, python: str, versions: dict, pip=None) -> list:
    """pip download of :data:`PACKAGES` (binary wheels for ``python`` on x86-64 manylinux) into ``out``."""
    reqs = [f'{p}=={versions[p]}' for p in PACKAGES]
    cmd = (pip or [sys.executable, '-m', 'pip']) + [
        'download', '--no-deps', '--only-binary=:all:', '--python-version', python, '--implementation', 'cp',
        '--abi', f"cp{python.replace('.', '')}", '--abi', 'abi3', '--abi', 'none', '-d', out]
    for p in PLATFORMS:
        cmd += ['--platform', p]
    log('downloading ' + ' '.join(reqs))
    subprocess.run(cmd + reqs, check=True)
    return reqs


def timm_scripts(out: str, version: str, repo=None, ref=None) -> str:
    """Copy timm's scripts at its tag ``v<version>`` into ``out``, from ``repo`` (a git clone holding that tag) or
    from a shallow clone of the tag. A clone without the tag, or a folder that is no git clone, is an error naming
    the tag: the scripts must match the pinned timm (a clone's checked-out tree could be any version). ``ref``
    (``--timm-ref``, with ``repo``): another ref, named by the caller and recorded as not the pinned tag. Returns
    where they came from (the ref and its commit)."""
    tag = f'v{version}'
    if ref is not None and repo is None:
        raise SystemExit('[gpu_bundle] --timm-ref needs --timm-repo (a clone holding that ref)')
    os.makedirs(out, exist_ok=True)
    tmp = None
    if repo is None:
        tmp = tempfile.mkdtemp()
        repo = os.path.join(tmp, 'timm')
        log(f'cloning {TIMM_GIT} at {tag}')
        r = subprocess.run(['git', 'clone', '-q', '--depth', '1', '--branch', tag, TIMM_GIT, repo],
                           capture_output=True, text=True)
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SystemExit(f'[gpu_bundle] could not clone timm\'s tag {tag} (the pinned timm=={version}) from '
                             f'{TIMM_GIT}: {r.stderr.strip()[-500:]}')
    try:
        use = ref or tag
        has_tag = subprocess.run(['git', '-C', repo, 'rev-parse', '-q', '--verify', f'{use}^{{commit}}'],
                                 capture_output=True, text=True)
        if has_tag.returncode != 0:
            if ref is not None:
                raise SystemExit(f'[gpu_bundle] --timm-repo {repo} has no ref {ref} (--timm-ref)')
            raise SystemExit(f'[gpu_bundle] --timm-repo {repo} has no tag {tag} (the pinned timm=={version}; '
                             f'constraints.txt): fetch it (git -C {repo} fetch origin tag {tag}), leave out '
                             '--timm-repo to clone the tag, or name another ref with --timm-ref (recorded as not the '
                             'pinned tag), or build with --no-timm-scripts (the GPU check then skips timm\'s scripts)')
        commit = has_tag.stdout.strip()
        for name in TIMM_SCRIPTS:
            blob = subprocess.run(['git', '-C', repo, 'show', f'{use}:{name}'], capture_output=True)
            if blob.returncode != 0:
                raise SystemExit(f'[gpu_bundle] timm\'s {use} in {repo} has no {name}')
            with open(os.path.join(out, name), 'wb') as f:
                f.write(blob.stdout)
        if ref is not None:
            log(f'timm\'s scripts from {ref} ({commit}), not the pinned tag {tag}: --timm-ref')
            return f'{TIMM_GIT} {ref} ({commit}), NOT the pinned tag {tag} (--timm-ref)'
        return f'{TIMM_GIT} {tag} ({commit})'
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def build(args) -> dict:
    versions = pins()
    out = os.path.abspath(args.out)
    wheels = os.path.join(out, 'wheels')
    os.makedirs(wheels, exist_ok=True)
    download_wheels(wheels, args.python, versions, shlex.split(args.pip) if args.pip else None)
    mmcv_version = versions['mmcv']
    links = list(args.mmcv_wheel or []) + list(args.find_links or []) + \
        os.environ.get('PIP_FIND_LINKS', '').split() + [os.path.join(os.path.dirname(ROOT), 'shared', 'wheels')]
    mmcv = find_mmcv_wheel(args.python, args.torch, args.arch, links, mmcv_version)
    if mmcv is None and args.build_mmcv:
        mmcv = build_mmcv(args, mmcv_version, wheels)
    if mmcv is None:
        folder = mmcv_folder_name(args.python, args.torch, args.arch)
        raise SystemExit(
            f'[gpu_bundle] no mmcv {mmcv_version} wheel for Python {args.python}, torch {args.torch}, sm_'
            f"{args.arch.replace('.', '')} in {links} (a folder named {folder} there, or --mmcv-wheel FILE): add "
            '--build-mmcv to build one here (~22 min on 2 cores), or build it on the GPU machine (docs/install.md)')
    if os.path.dirname(os.path.abspath(mmcv)) != wheels:
        shutil.copyfile(mmcv, os.path.join(wheels, os.path.basename(mmcv)))
    if args.no_timm_scripts:
        shutil.rmtree(os.path.join(out, 'timm_scripts'), ignore_errors=True)
        scripts_from = None
        log('no timm scripts (--no-timm-scripts): the GPU check records its timm steps as not run')
    else:
        scripts_from = timm_scripts(os.path.join(out, 'timm_scripts'), versions['timm'], args.timm_repo,
                                    args.timm_ref)
    files = {}
    for folder in ('wheels', 'timm_scripts'):
        for name in sorted(os.listdir(os.path.join(out, folder))) if os.path.isdir(os.path.join(out, folder)) else []:
            files[f'{folder}/{name}'] = sha256(os.path.join(out, folder, name))
    manifest = dict(command=shlex.join(['python', 'tools/gpu_bundle.py'] + sys.argv[2:] if args.argv is None
                                       else ['python', 'tools/gpu_bundle.py'] + args.argv),
                    date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
                    target=dict(python=args.python, torch=args.torch, cuda_arch=args.arch),
                    mmcv_from=os.path.abspath(mmcv), timm_scripts_from=scripts_from, files=files)
    with open(os.path.join(out, 'MANIFEST.json'), 'w') as f:
        json.dump(manifest, f, indent=1)
    size = sum(os.path.getsize(os.path.join(out, k)) for k in files) / 2 ** 20
    log(f'wrote {out}: {len(files)} files, {size:.1f} MiB')
    return manifest


def build_mmcv(args, version: str, out: str) -> str:
    """mmcv with CUDA ops for the target, in a scratch virtualenv of the target Python with the target torch."""
    env_dir = tempfile.mkdtemp(prefix='mmcv-venv-')
    py = shutil.which(f'python{args.python}')
    if py is None:
        raise SystemExit(f'[gpu_bundle] --build-mmcv needs python{args.python} on PATH (e.g. pyenv)')
    subprocess.run([py, '-m', 'venv', env_dir], check=True)
    vpy = os.path.join(env_dir, 'bin', 'python')
    torch_version = args.torch.split('+')[0]
    subprocess.run([vpy, '-m', 'pip', 'install', '-q', f'torch=={torch_version}', 'setuptools<81', 'wheel', 'ninja',
                    'numpy'], check=True)
    log(f'building mmcv {version} for sm_{args.arch} (FORCE_CUDA=1): ~22 minutes on 2 cores')
    subprocess.run(['bash', os.path.join(ROOT, 'tools', 'build_mmcv_wheel.sh'), '--python', vpy, '--out', out],
                   check=True, env=dict(os.environ, FORCE_CUDA='1', TORCH_CUDA_ARCH_LIST=args.arch))
    return find_mmcv_wheel(args.python, args.torch, args.arch, [out], version)


def wheel_dist(path: str):
    """``(name, version)`` from a wheel's file name."""
    name, version = os.path.basename(path).split('-')[:2]
    return name.replace('_', '-').lower(), version


def install(args) -> list:
    """Install the bundle's wheels (those not installed at their version) and this checkout into the running
    Python, offline; then check that the detection stack imports with its compiled ops."""
    import importlib.metadata as md
    bundle = os.path.abspath(args.bundle)
    with open(os.path.join(bundle, 'MANIFEST.json')) as f:
        manifest = json.load(f)
    for rel, digest in manifest['files'].items():
        if sha256(os.path.join(bundle, rel)) != digest:
            raise SystemExit(f'[gpu_bundle] {rel} does not match MANIFEST.json (a truncated copy?)')
    todo = []
    for rel in manifest['files']:
        if rel.startswith('wheels/') and rel.endswith('.whl'):
            name, version = wheel_dist(rel)
            try:
                have = md.version(name)
            except md.PackageNotFoundError:
                have = None
            if have != version:
                todo.append(os.path.join(bundle, rel))
    pip = [sys.executable, '-m', 'pip', 'install', '--no-index', '--no-deps', '--no-compile',
           '--disable-pip-version-check', '-q']
    steps = []
    if todo:
        steps.append(pip + todo)
    steps.append(pip + ['--no-build-isolation', '--force-reinstall', ROOT])  # this checkout, with its autoload .pth
    for cmd in steps:
        log(shlex.join(cmd) if not args.dry_run else 'dry run: ' + shlex.join(cmd))
        if not args.dry_run:
            subprocess.run(cmd, check=True)
    record = dict(ok=False, dry_run=bool(args.dry_run), bundle=bundle, wheels=[os.path.basename(p) for p in todo],
                  commands=[shlex.join(c) for c in steps])
    if not args.dry_run:
        check = subprocess.run(
            [sys.executable, '-c', 'from mmcv.ops import RoIAlign, nms; import mmdet, timm, timm_lambda, json; '
             'import importlib.metadata as m; print(json.dumps({d: m.version(d) for d in ("torch", "timm", "mmcv", '
             '"mmengine", "mmdet", "timm-lambda")}))'], check=True, cwd='/', capture_output=True, text=True)
        record['versions'] = json.loads(check.stdout.strip().splitlines()[-1])
        log('installed: ' + ', '.join(f'{k} {v}' for k, v in record['versions'].items()))
    record['ok'] = True  # every command above ran (check=True) and, on a real install, the stack imports
    if args.record:
        with open(args.record, 'w') as f:
            json.dump(record, f, indent=1)
    return steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = p.add_subparsers(dest='what', required=True)
    b = sub.add_parser('build', help='on a connected machine: write the bundle folder')
    b.add_argument('--out', default='gpu_bundle', help='the bundle folder (default: %(default)s, git-ignored)')
    b.add_argument('--python', default='3.12', help="the target's Python (default: %(default)s)")
    b.add_argument('--torch', default='2.11.0+cu130', help="the target's torch (default: %(default)s)")
    b.add_argument('--arch', default='9.0', help='the target GPU arch for mmcv (default: %(default)s, H100/H200)')
    b.add_argument('--mmcv-wheel', action='append', help='an mmcv wheel for the target, or a folder holding one')
    b.add_argument('--find-links', action='append', help='a folder to look for the mmcv wheel in (or PIP_FIND_LINKS)')
    b.add_argument('--build-mmcv', action='store_true', help='build mmcv here when no wheel is found (~22 min)')
    b.add_argument('--timm-repo', default=None, help="a clone of timm's repository (default: clone the pinned tag)")
    b.add_argument('--timm-ref', default=None, help="with --timm-repo: timm's scripts from this ref, not the pinned "
                   'tag (recorded so in MANIFEST.json)')
    b.add_argument('--no-timm-scripts', action='store_true', help="a bundle without timm's scripts (no clone with "
                   "the pinned tag here): the GPU check records timm's steps as not run")
    b.add_argument('--pip', default=None, help='the pip command (default: this Python\'s pip)')
    i = sub.add_parser('install', help='on the GPU machine: install the bundle and this checkout, offline')
    i.add_argument('--bundle', default='gpu_bundle')
    i.add_argument('--dry-run', action='store_true', help='check the bundle and print the pip commands only')
    i.add_argument('--record', default=None, help='a JSON file: what was installed, and ok once the stack imports')
    args = p.parse_args(argv)
    args.argv = argv
    return build(args) if args.what == 'build' else install(args)


if __name__ == '__main__':
    main()
