#!/usr/bin/env python
"""The GPU check: the project on a fresh, offline CUDA machine in two commands of a few minutes each.

Run from a checkout with the offline bundle beside it (``tools/gpu_bundle.py build``; nothing else installed)::

    python3 tools/gpu_check.py layer   --bundle gpu_bundle --out OUT   # 1: CUDA kernel tests, layer vs cuDNN's conv
    python3 tools/gpu_check.py mission --bundle gpu_bundle --out OUT   # 2: Mask R-CNN, timm's train.py, models

``layer``: installs the bundle, ``pytest -m cuda`` on the position-lambda tests with strict executions
(``TIMM_LAMBDA_STRICT=1``: a kernel that fails to launch fails its test), one lambda layer against cuDNN's 3x3
convolution at LambdaResNet-101's three 1024 px shapes (each CUDA backend; float32 with TF32 and bfloat16 autocast;
batch 1 and 8; training step and eval; ``benchmark_lambda_layer.py --gpu-check``), where a layer step's GPU time goes
and a sweep of the tensor-core kernels' tiles, warps and stages (``tune_tc_kernels.py``), batch-1 training steps eager
against CUDA graphs (layers, LambdaResNet-101, the C4 pair: ``benchmark_models.py graphs``), and LambdaResNet-101
against ResNet-RS-101 with and without SE at 1024 px, batch 1. ``mission``: the model tests of ``pytest -m cuda`` (a
training step of every registered model, batch 1), Mask R-CNN from the Table 14 AMP config shrunk to 512 px for 20
iterations with mmdet's own ``tools/train.py`` on a generated COCO-format set and ``tools/test.py`` (bbox and segm AP
by pycocotools), timm's own ``train.py`` for 2 epochs with ``--amp --channels-last`` on a generated ImageFolder and
``validate.py``, and the model benchmarks (LambdaResNet-101-C4 vs its conv twin at 512 px; LambdaResNet-101 vs
RS-101+SE at 1024 px, batch 4, and LambdaResNet-50 vs timm's ``lambda_resnet50ts`` at 224 px, float32 and bf16),
last LambdaResNet-101's batch-1 training step at 1024 px eager, from hand-made CUDA graphs and under
``torch.compile(mode='reduce-overhead')``.

Each step runs in its own process under its own time limit (the section's ``--budget`` shared out), so one hang
costs only its step. ``OUT`` receives two files per section: ``gpu_check_<section>.json`` (command, date, commit,
GPU, driver, torch, Triton, every step's exit code and time, the test counts and every figure) and
``gpu_check_<section>.tar.gz`` (the logs and raw JSON of each step).

``--dry-run``: the same steps on the CPU at tiny sizes (CI runs it: tests/test_gpu_check.py), the bundle's install
only checked; it proves that every step starts, every path exists and every output is written.
"""
import argparse
import glob
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time

from dev.benchmarks.measure import commit, cpu_model  # the tools' shared helpers (tools/dev)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, 'tools')
PY = sys.executable

# The position-lambda tests (command 1) and the model tests (command 2) of tests/test_cuda.py; mmdet's tools run in
# the mission's own Mask R-CNN step.
KERNEL_TESTS = 'not training_step and not batch_one and not mmdet'
MODEL_TESTS = '(training_step or batch_one) and not mmdet'


# ----------------------------------------------------------------------------------------------------------
# facts about the run


def machine() -> dict:
    """GPU, driver, torch, CUDA, cuDNN, Triton, CPU and load of this machine."""
    import torch
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                cpu=cpu_model(), cores=os.cpu_count(), load=os.getloadavg()[0])
    try:
        import triton
        info['triton'] = triton.__version__
    except ImportError:
        info['triton'] = None
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(), cudnn=torch.backends.cudnn.version(),
                    gpu_memory_mib=torch.cuda.get_device_properties(0).total_memory // 2 ** 20)
        smi = shutil.which('nvidia-smi')
        if smi:
            q = subprocess.run([smi, '--query-gpu=driver_version', '--format=csv,noheader'], capture_output=True,
                               text=True)
            info['driver'] = q.stdout.strip() or None
    else:
        info['gpu'] = None
    return info


# ----------------------------------------------------------------------------------------------------------
# steps


class Run:
    """One section's steps, their logs and results, and the time left of its budget."""

    def __init__(self, section: str, out: str, budget: float, dry_run: bool, argv, skip=()):
        self.section, self.dry_run, self.t0, self.budget = section, dry_run, time.time(), budget
        self.skip = set(skip)
        self.out = os.path.abspath(out)
        # logs, raw JSON, work dirs: packed at the end; outside OUT, which must hold only the two result files
        self.scratch = os.path.join(tempfile.gettempdir(), f'gpu_check_{os.getpid()}')
        self.work = os.path.join(self.scratch, f'{section}_files')
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.out, exist_ok=True)
        os.makedirs(self.work)
        self.record = dict(section=section, command=shlex.join(['python', 'tools/gpu_check.py'] + argv),
                           date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), commit=commit(),
                           dry_run=dry_run, machine=machine(), steps=[], results={})
        self.env = dict(os.environ, PYTHONUNBUFFERED='1', PYTHONWARNINGS='ignore',
                        PYTHONPATH=os.pathsep.join([ROOT, TOOLS] + [p for p in [os.environ.get('PYTHONPATH')] if p]),
                        # strict executions: a kernel that fails is an error, never a silent fallback
                        TIMM_LAMBDA_STRICT='1')

    def left(self) -> float:
        return self.budget - (time.time() - self.t0)

    def step(self, name: str, cmd, limit: float, cwd=ROOT, env=None) -> int:
        """Run ``cmd`` with its output in ``<name>.log``, for at most ``limit`` seconds and what the budget
        leaves (25 s kept for stopping and packing); its exit code (124 when stopped at the limit, None when never
        started)."""
        if self.dry_run:  # a CPU at tiny sizes, maybe shared (CI): slower than the GPU, and no budget to keep
            limit *= 4
        else:
            limit = min(limit, self.left() - 25)
        log_path = os.path.join(self.work, f'{name}.log')
        entry = dict(name=name, command=shlex.join(cmd), log=os.path.relpath(log_path, self.scratch),
                     limit_s=round(limit))
        self.record['steps'].append(entry)
        if name in self.skip:
            entry.update(rc=None, seconds=0, skipped=True, note='not started: --skip')
            print(f'[gpu_check] {name}: skipped (--skip)', flush=True)
            return None
        if limit < 5:
            entry.update(rc=None, seconds=0, note='not started: the section\'s time budget is spent')
            print(f'[gpu_check] {name}: not started (budget spent)', flush=True)
            return None
        t = time.time()
        print(f'[gpu_check] {name}: {entry["command"][:300]}', flush=True)
        with open(log_path, 'w') as log:
            proc = subprocess.Popen(cmd, cwd=cwd, env=dict(self.env, **(env or {})), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:  # SIGINT first: pytest and Python scripts then write what they have
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                rc = 124
        entry.update(rc=rc, seconds=round(time.time() - t, 1), timed_out=rc == 124)
        with open(log_path, errors='replace') as f:
            text = f.read()
        if rc != 0:
            entry['tail'] = text[-3000:]
        print(f'[gpu_check] {name}: exit {rc} in {entry["seconds"]} s' + ('' if rc == 0 else '\n' + text[-1500:]),
              flush=True)
        return rc

    def path(self, *parts) -> str:
        return os.path.join(self.work, *parts)

    def finish(self) -> str:
        """Write ``gpu_check_<section>.json`` and ``gpu_check_<section>.tar.gz`` into ``out``."""
        self.record['seconds'] = round(time.time() - self.t0, 1)
        self.record['ok'] = all(s.get('rc') == 0 or s.get('skipped') for s in self.record['steps'])
        summary = os.path.join(self.out, f'gpu_check_{self.section}.json')
        with open(summary, 'w') as f:
            json.dump(self.record, f, indent=1, default=str)
        with tarfile.open(os.path.join(self.out, f'gpu_check_{self.section}.tar.gz'), 'w:gz') as tar:
            for p in sorted(glob.glob(os.path.join(self.work, '*'))):
                if p.endswith(('.log', '.json', '.xml', '.csv')):  # no checkpoints or images
                    tar.add(p, arcname=os.path.relpath(p, self.scratch))
        shutil.rmtree(self.scratch, ignore_errors=True)
        print(f'[gpu_check] {self.section}: {"ok" if self.record["ok"] else "FAILED steps"} in '
              f'{self.record["seconds"]} s; wrote {summary}', flush=True)
        return summary


def install(run: Run, bundle) -> None:
    """The bundle into this Python (offline); a dry run checks it and prints the commands."""
    if bundle is None:
        run.record['results']['install'] = 'no bundle given: the installed packages are used'
        return
    cmd = [PY, os.path.join(TOOLS, 'gpu_bundle.py'), 'install', '--bundle', bundle]
    run.step('install', cmd + (['--dry-run'] if run.dry_run else []), 180)
    import importlib
    importlib.invalidate_caches()  # the packages just installed, for this process's imports


def pytest_step(run: Run, name: str, select: str, workers: int, limit: float) -> None:
    """``pytest -m cuda tests/test_cuda.py -k select``, counts and failures from its JUnit XML."""
    xml = run.path(f'{name}.xml')
    cmd = [PY, '-m', 'pytest', '-p', 'no:cacheprovider', '-o', 'addopts=', '-m', 'cuda', 'tests/test_cuda.py',
           '-k', select, '-q', '--tb=short', '-rfE', f'--junitxml={xml}']
    if workers > 1:
        cmd += ['-n', str(workers)]
    rc = run.step(name, cmd, limit)
    run.record['results'][name] = junit_counts(xml) if os.path.exists(xml) else dict(rc=rc, note='no JUnit XML')


def junit_counts(path: str) -> dict:
    import xml.etree.ElementTree as ET
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == 'testsuite' else list(root)
    counts = dict(tests=0, failures=0, errors=0, skipped=0)
    failed = []
    for s in suites:
        for k in counts:
            counts[k] += int(s.get(k, 0))
        for case in s.iter('testcase'):
            if case.find('failure') is not None or case.find('error') is not None:
                failed.append(case.get('name'))
    counts['passed'] = counts['tests'] - counts['failures'] - counts['errors'] - counts['skipped']
    counts['failed_tests'] = failed[:100]
    return counts


# ----------------------------------------------------------------------------------------------------------
# section 1: kernels


def layer_summary(path: str) -> list:
    """Per (execution, dtype, batch, mode): the layer's time over the conv's at each shape and summed."""
    with open(path) as f:
        runs = json.load(f)
    rows = []
    for r in runs:
        s = r['settings']
        if 'error' in r:
            rows.append(dict(execution=r['execution'], **s, error=r['error']))
            continue
        shapes = [(f"{x['width']}ch {x['size']}px s{x['stride']}", x['auto']['ms'], x['conv3x3']['ms'],
                   x['auto']['peak_mib'], x['conv3x3']['peak_mib']) for x in r['results']]
        rows.append(dict(execution=r['execution'], dtype=s['dtype'], batch=s['batch'], mode=s['mode'], tf32=s['tf32'],
                         triton_launches=r.get('triton_launches'),
                         shapes={k: dict(layer_ms=round(a, 3), conv_ms=round(c, 3), ratio=round(a / c, 2),
                                         layer_peak_mib=round(m, 1), conv_peak_mib=round(cm, 1))
                                 for k, a, c, m, cm in shapes},
                         ratio_summed=round(sum(x[1] for x in shapes) / sum(x[2] for x in shapes), 2)))
    return rows


def tc_kernels_summary(path: str) -> dict:
    """From tools/tune_tc_kernels.py's JSON: each layer step's device time, its five largest kernels and the five
    aten operators (with input shapes) whose own kernels took longest; each
    tensor-core kernel's time at the wrappers' constants, its best alternative and the speedup; at batch 1, the
    small-grid tiles' speedup over the full-grid ones; the host's microseconds a call of an aten op, a Triton launch
    and a layer / conv step on a tiny map, and the eight functions that take most of the layer step's own host time."""
    with open(path) as f:
        rows = json.load(f)['rows']
    profile = [dict(shape=r['shape'], module=r['module'], dtype=r['dtype'], device_us=r['device_us_per_step'],
                    wall_us=r.get('wall_us_per_step'), host_cpu_us=r.get('host_cpu_us_per_step'),
                    launches=r['launches_per_step'],
                    top={k: v['us_per_step'] for k, v in list(r['kernels'].items())[:5]},
                    top_ops={k: v['us_per_step'] for k, v in list(r.get('ops', {}).items())[:5]})
               for r in rows if r['part'] == 'profile']
    sweep = [dict(shape=r['shape'], dtype=r['dtype'], kernel=r['kernel'],
                  default_ms=(r['default'] or {}).get('ms'), best=r['best'], speedup=r['speedup'],
                  configs=len(r['configs']), errors=sum('error' in c for c in r['configs']))
             for r in rows if r['part'] == 'sweep']
    occupancy = [dict(shape=r['shape'], dtype=r['dtype'], kernel=r['kernel'], speedup=r['speedup'],
                      ms=[c.get('ms') for c in r['configs']], errors=sum('error' in c for c in r['configs']))
                 for r in rows if r['part'] == 'occupancy']
    host = next((r for r in rows if r['part'] == 'host'), {})
    return dict(profile=profile, host_us_per_call=host.get('host_us_per_call'),
                host_python_top=dict(list(host.get('python_top', {}).items())[:8]), occupancy=occupancy, sweep=sweep)


def section_layer(run: Run, args) -> None:
    install(run, args.bundle)
    pytest_step(run, 'cuda_tests_kernels', KERNEL_TESTS, args.workers, 110)
    run.step('layer_benchmarks', [PY, os.path.join(TOOLS, 'benchmark_lambda_layer.py'), '--gpu-check', run.path()]
             + (['--tiny'] if run.dry_run else []), 140)
    if os.path.exists(run.path('layer_benchmarks.json')):  # what was measured, also where the step ran out of time
        run.record['results']['layer_vs_conv'] = layer_summary(run.path('layer_benchmarks.json'))
    if os.path.exists(run.path('graphs.json')):
        with open(run.path('graphs.json')) as f:
            run.record['results']['cuda_graphs_batch1'] = json.load(f)
    # where a layer step's GPU time goes, and the tensor-core kernels' tiles, warps and stages (the tool stops itself
    # at its budget and keeps what it measured)
    limit = 100 if run.dry_run else min(100, run.left() - 25)  # (a dry run's steps get 4x their limit)
    run.step('tune_tc_kernels', [PY, os.path.join(TOOLS, 'tune_tc_kernels.py'), '--out', run.path(), '--budget',
                                 str(round(max(limit * (4 if run.dry_run else 1) - 15, 5)))]
             + (['--dry-run'] if run.dry_run else []), limit)
    if os.path.exists(run.path('tune_tc_kernels.json')):
        run.record['results']['tc_kernels'] = tc_kernels_summary(run.path('tune_tc_kernels.json'))
    model_benchmarks(run, MODEL_BENCHMARKS[:2])


# ----------------------------------------------------------------------------------------------------------
# section 2: the mission


def mask_rcnn(run: Run) -> None:
    """Mask R-CNN (Table 14's LambdaResNet-101 config, the AMP one on a GPU) at 512 px (64 in a dry run) on a
    generated COCO-format set: mmdet's tools/train.py for 20 iterations (2), then tools/test.py."""
    import mmdet

    from dev.synthetic_coco import make_coco_dataset
    from timm_lambda_mmdet.overrides import small_run_overrides, to_cli_options
    tools = os.path.join(os.path.dirname(mmdet.__file__), '.mim', 'tools')
    amp = '' if run.dry_run else 'amp-'
    config = os.path.join(ROOT, 'configs', 'mmdet', f'mask-rcnn_lambdaresnet101_fpn_syncbn_{amp}lsj-130k_coco.py')
    size, iters = (64, 2) if run.dry_run else (512, 20)
    root = run.path('coco')
    make_coco_dataset(root, num_train=4 if run.dry_run else 16, num_val=2 if run.dry_run else 8, image_size=size,
                      seed=3)
    classes = ('square', 'circle', 'triangle', 'star')
    opts = dict(image_size=size, classes=classes, num_classes=len(classes), validate=False)
    work, test_dir = run.path('mmdet_train'), run.path('mmdet_test')
    rc = run.step('mmdet_train', [PY, os.path.join(tools, 'train.py'), config, '--work-dir', work, '--cfg-options']
                  + to_cli_options(small_run_overrides(root, max_iters=iters, batch_size=2, **opts)), 100)
    ckpt = os.path.join(work, f'iter_{iters}.pth')
    res = dict(config=os.path.relpath(config, ROOT), image_size=size, iterations=iters, train_rc=rc)
    res['losses'] = _mmdet_losses(work)
    rc = run.step('mmdet_test', [PY, os.path.join(tools, 'test.py'), config, ckpt, '--work-dir', test_dir,
                                 '--cfg-options'] + to_cli_options(small_run_overrides(root, **opts)), 60)
    res['test_rc'] = rc
    res['metrics'] = _mmdet_metrics(test_dir)
    run.record['results']['mask_rcnn'] = res
    for d in (work, test_dir, root):  # checkpoints and images stay behind; the logs are packed
        for p in glob.glob(os.path.join(d, '**', '*.json'), recursive=True) + \
                glob.glob(os.path.join(d, '**', '*.log'), recursive=True):
            if 'annotations' not in p:
                shutil.copy(p, run.path(f'{os.path.basename(d)}_{os.path.basename(p)}'))


def _mmdet_losses(work: str) -> dict:
    """First and last logged training loss (mmengine's vis_data/scalars.json)."""
    rows = []
    for path in glob.glob(os.path.join(work, '*', 'vis_data', 'scalars.json')):
        with open(path) as f:
            rows += [json.loads(line) for line in f if '"loss"' in line]
    return dict(first=rows[0]['loss'], last=rows[-1]['loss'], logged=len(rows)) if rows else {}


def _mmdet_metrics(test_dir: str) -> dict:
    for path in sorted(glob.glob(os.path.join(test_dir, '*', '*.json'))):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if 'coco/bbox_mAP' in rec:
                    return {k: v for k, v in rec.items() if k.startswith('coco/')}
    return {}


def image_folder(root: str, classes, per_class: int, size: int) -> None:
    """A generated ImageFolder (``root/train/<class>/*.png``, ``root/val/...``) from dev.datasets.SyntheticShapes."""
    from dev.datasets import SyntheticShapes
    n = per_class * len(classes)
    for split, n in (('train', n), ('val', max(len(classes), n // 4))):
        data = SyntheticShapes(n, size, classes=classes, split=split, seed=0)
        for i in range(len(data)):
            img, label = data[i]
            d = os.path.join(root, split, classes[label])
            os.makedirs(d, exist_ok=True)
            img.save(os.path.join(d, f'{i:04d}.png'))


def timm_scripts(run: Run, bundle) -> None:
    """timm's own train.py (2 epochs, --amp, --channels-last) and validate.py on LambdaResNet-50 (registered in timm
    by the autoload hook: no change to the scripts)."""
    scripts = os.path.join(bundle, 'timm_scripts') if bundle else os.environ.get('TIMM_SCRIPTS')
    res = run.record['results'].setdefault('timm_scripts', {})
    if not scripts or not os.path.isfile(os.path.join(scripts, 'train.py')):
        res['note'] = 'timm\'s scripts not found: --bundle (timm_scripts/) or TIMM_SCRIPTS=<folder with train.py>'
        run.record['steps'].append(dict(name='timm_train', rc=None, note=res['note']))
        return
    classes = ('disc', 'triangle', 'checker', 'v_stripes')
    size = 32 if run.dry_run else 128
    data = run.path('imagefolder')
    image_folder(data, classes, 4 if run.dry_run else 64, size)
    out = run.path('timm_train')
    common = ['--model', 'lambdaresnet50', '--num-classes', str(len(classes)), '--img-size', str(size), '--amp',
              '--channels-last', '--workers', '2']
    rc = run.step('timm_train', [PY, os.path.join(scripts, 'train.py'), '--data-dir', data, '--train-split', 'train',
                                 '--val-split', 'val', '-b', '8' if run.dry_run else '32', '--epochs', '2',
                                 '--warmup-epochs', '0', '--lr', '0.02', '--output', out, '--experiment', 'run',
                                 '--log-interval', '1', '--checkpoint-hist', '1'] + common
                  + (['--device', 'cpu', '--no-prefetcher', '--amp-dtype', 'bfloat16'] if run.dry_run else []), 80)
    res['train_rc'] = rc
    summary = os.path.join(out, 'run', 'summary.csv')
    if os.path.exists(summary):
        shutil.copy(summary, run.path('timm_train_summary.csv'))
        with open(summary) as f:
            res['summary_csv'] = f.read().strip().splitlines()
    ckpt = os.path.join(out, 'run', 'last.pth.tar')
    results_file = run.path('timm_validate.json')
    rc = run.step('timm_validate', [PY, os.path.join(scripts, 'validate.py'), '--data-dir', data, '--split', 'val',
                                    '--checkpoint', ckpt, '-b', '16', '--results-file', results_file,
                                    '--results-format', 'json'] + common
                  + (['--device', 'cpu', '--no-prefetcher', '--amp-dtype', 'bfloat16'] if run.dry_run else []), 40)
    res['validate_rc'] = rc
    if os.path.exists(results_file):
        with open(results_file) as f:
            res['validate'] = json.load(f)


MODEL_BENCHMARKS = [  # name, arguments (GPU), arguments (dry run)
    ('models_graphs', ['graphs', '--device', 'cuda', '--repeats', '15'],
     ['graphs', '--device', 'cpu', '--sizes', '64', '--repeats', '1']),
    ('models_backbone_b1', ['backbone', '--device', 'cuda', '--repeats', '10'],
     ['backbone', '--sizes', '64', '--repeats', '1']),
    ('models_c4', ['c4', '--device', 'cuda', '--repeats', '10'], ['c4', '--sizes', '64', '--repeats', '1']),
    ('models_cuda', ['cuda', '--repeats', '10'],
     ['cuda', '--device', 'cpu', '--sizes', '64', '32', '--batch', '1', '--classifier-batch', '2', '--repeats', '1']),
    # last: CUDA graphs by hand against torch.compile(mode='reduce-overhead') for the detection backbone (issue 37)
    ('models_reduce_overhead', ['graphs', '--device', 'cuda', '--repeats', '10', '--reduce-overhead'],
     ['graphs', '--device', 'cpu', '--sizes', '64', '--repeats', '1', '--reduce-overhead'], 240),
]


def model_benchmarks(run: Run, which) -> None:
    res = run.record['results'].setdefault('models', {})
    for name, gpu, dry, *limit in which:
        path = run.path(f'{name}.json')
        rc = run.step(name, [PY, os.path.join(TOOLS, 'benchmark_models.py')] + (dry if run.dry_run else gpu)
                      + ['--json', path], limit[0] if limit else 70)
        if rc == 0 and os.path.exists(path):
            with open(path) as f:
                res[name] = json.load(f)


def section_mission(run: Run, args) -> None:
    install(run, args.bundle)
    pytest_step(run, 'cuda_tests_models', MODEL_TESTS, args.workers, 90)
    mask_rcnn(run)
    timm_scripts(run, args.bundle)
    model_benchmarks(run, MODEL_BENCHMARKS[2:])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('section', choices=['layer', 'mission'])
    p.add_argument('--bundle', default=None, help='the offline bundle folder (tools/gpu_bundle.py build)')
    p.add_argument('--out', default='work_dirs/gpu_check', help='where the two result files go')
    p.add_argument('--budget', type=float, default=420, help='seconds for the whole section (default: %(default)s)')
    p.add_argument('--workers', type=int, default=None, help='pytest-xdist workers (default: cores / 2, at most 8)')
    p.add_argument('--skip', default='', help='comma-separated step names not to run (a short slot: the steps '
                   'measured before), e.g. cuda_tests_models,timm_train')
    p.add_argument('--dry-run', action='store_true', help='CPU, tiny sizes: every step starts and writes its output')
    args = p.parse_args(argv)
    if args.workers is None:
        args.workers = 1 if args.dry_run else min(8, max(1, (os.cpu_count() or 2) // 2))
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit('gpu_check: no CUDA device (torch.cuda.is_available() is False); --dry-run runs the steps '
                         'on the CPU')
    if args.bundle:
        args.bundle = os.path.abspath(args.bundle)
    run = Run(args.section, args.out, args.budget, args.dry_run, argv, skip=[x for x in args.skip.split(',') if x])
    (section_layer if args.section == 'layer' else section_mission)(run, args)
    return run.finish()


if __name__ == '__main__':
    main()
