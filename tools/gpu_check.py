#!/usr/bin/env python
"""The GPU check: the project on a fresh, offline CUDA machine in one command that fits a 15-minute device slot.

Run from a checkout with the offline bundle beside it (``tools/gpu_bundle.py build``; nothing else installed)::

    python3 tools/gpu_check.py all --bundle gpu_bundle --out OUT     # ~9 min on an H200, install included

Its steps, in order of value (each in its own process under its own time limit, from the section's ``--budget``,
default 540 s): install the bundle; the CUDA kernel tests (``pytest -m cuda`` on the position-lambda tests with
strict executions, ``TIMM_LAMBDA_STRICT=1``: a kernel that fails to launch fails its test); the layer table (one
lambda layer against cuDNN's 3x3 convolution at LambdaResNet-101's three 1024 px shapes, each CUDA backend, float32
with TF32 and bfloat16 autocast, batch 1 and 8, training step and eval: ``benchmark_lambda_layer.py --gpu-check``);
Mask R-CNN in the mission's own setting through mmdet's ``tools/train.py`` (Table 14's AMP config at 1024 px with
large-scale jitter, 2 images a GPU, 5 warm-up and 30 timed iterations on a generated COCO-format set), LambdaResNet-101
and ResNet-RS-101+SE side by side (seconds an iteration and peak memory each), then ``tools/test.py`` on the
LambdaResNet-101 checkpoint (bbox and segm AP by pycocotools); timm's own ``train.py`` (2 epochs, ``--amp
--channels-last``) and ``validate.py`` on a generated ImageFolder; where a layer step's GPU time goes and a sweep of
the tensor-core kernels' tiles (``tune_tc_kernels.py``); the model comparisons (``benchmark_models.py``: batch-1
training steps eager against CUDA graphs, LambdaResNet-101 against ResNet-RS-101 with and without SE, the C4 pair,
LambdaResNet-50 against timm's ``lambda_resnet50ts``, ``torch.compile(mode='reduce-overhead')``); last the model
tests (a training step of every registered model, batch 1). ``layer`` and ``mission`` run the first and the second
half of these (two shorter commands, as before).

A step starts only while the budget leaves it its ``need_s`` (else it is recorded ``not run: budget``); it is stopped
at its ``limit_s``. A step is ``ok`` only if its own result (JUnit XML, JSON, mmengine's logged scalars, timm's
summary CSV) exists and says that it passed, and its process exited 0: an exit code alone proves nothing (run 5's
``reduce-overhead`` step exited 0 with its compiled step failed). ``OUT`` receives ``gpu_check_<section>.json``
(command, date, commit with ``+dirty``, GPU, driver, torch, Triton; every step's status, time and ``ok``; every
figure), also when steps fail or do not run, and ``gpu_check_<section>.tar.gz`` (the logs and raw JSON of each step).
The command exits 1 when a step failed.

``--dry-run``: the same steps and code paths on the CPU at tiny sizes (CI runs it: tests/test_gpu_check.py; Mask
R-CNN at 64 px for 1 + 2 iterations without AMP), the bundle's install only checked; it proves that every step
starts, every path exists and every output is written and checked.
"""
import argparse
import glob
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

from _lib.provenance import commit, cpu_model  # the one commit() of every result (benchmarks/harness)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, 'tools')
BENCHMARKS = os.path.join(ROOT, 'benchmarks')  # the measurement programs this check runs
PY = sys.executable

# The position-lambda tests and the model tests of tests/test_cuda.py; mmdet's tools run in the Mask R-CNN steps.
KERNEL_TESTS = 'not training_step and not batch_one and not mmdet'
MODEL_TESTS = '(training_step or batch_one) and not mmdet'
BUDGET = 540  # seconds for ``all`` on a GPU: a 600 s command (the device's limit a command) with time to pack
RESERVE = 20  # seconds of the budget kept for writing the summary and packing the logs


# ----------------------------------------------------------------------------------------------------------
# facts about the run


def machine() -> dict:
    """GPU, driver, torch, CUDA, cuDNN, Triton, CPU and load of this machine."""
    import torch
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                cpu=cpu_model(), cores=os.cpu_count(), load=os.getloadavg()[0], gpu=None, driver=None)
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
    return info


# ----------------------------------------------------------------------------------------------------------
# steps


class Run:
    """One section's steps, their logs and results, and the time left of its budget (None: no budget)."""

    def __init__(self, section: str, out: str, budget, dry_run: bool, argv, skip=()):
        self.section, self.dry_run, self.t0, self.budget = section, dry_run, time.time(), budget
        self.skip = set(skip)
        self.out = os.path.abspath(out)
        # logs, raw JSON, work dirs: packed at the end; outside OUT, which must hold only the two result files
        self.scratch = os.path.join(tempfile.gettempdir(), f'gpu_check_{os.getpid()}')
        self.work = os.path.join(self.scratch, f'{section}_files')
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.out, exist_ok=True)
        os.makedirs(self.work)
        self.record = dict(section=section, command=shlex.join(['python', 'tools/gpu_check.py'] + list(argv)),
                           date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), commit=commit(),
                           dry_run=dry_run, budget_s=budget, machine=machine(), steps=[], results={})
        self.env = dict(os.environ, PYTHONUNBUFFERED='1', PYTHONWARNINGS='ignore',
                        PYTHONPATH=os.pathsep.join([ROOT, TOOLS] + [p for p in [os.environ.get('PYTHONPATH')] if p]),
                        # strict executions: a kernel that fails is an error, never a silent fallback
                        TIMM_LAMBDA_STRICT='1')

    def left(self) -> float:
        return math.inf if self.budget is None else self.budget - (time.time() - self.t0)

    def not_run(self, name: str, why: str, **extra) -> None:
        """Record a step that does not start (``why``: ``budget``, ``--skip`` or a missing input)."""
        self.record['steps'].append(dict(name=name, status=f'not run: {why}', ok=None, rc=None, seconds=0, **extra))
        print(f'[gpu_check] {name}: not run: {why}', flush=True)

    def step(self, name: str, cmd, limit: float, check, need: float = None, cwd=ROOT, env=None):
        """Run ``cmd`` with its output in ``<name>.log`` for at most ``limit`` seconds (4x in a dry run) and what the
        budget leaves (:data:`RESERVE` kept); not at all where it leaves less than ``need`` (default ``limit / 2``).
        ``check()`` then reads the step's own result: ``(passed, why)``. The step's entry (``status``: ``passed``,
        ``failed`` or ``not run: ...``; ``ok``; ``rc``: 124 when stopped at the limit, None when not started)."""
        if name in self.skip:
            return self.not_run(name, '--skip')
        need = limit / 2 if need is None else need
        if self.dry_run:  # a CPU at tiny sizes, maybe shared (CI): slower than the GPU
            limit, need = limit * 4, need * 4
        left = self.left() - RESERVE
        if left < need:
            return self.not_run(name, 'budget', need_s=round(need), left_s=round(max(left, 0)))
        limit = min(limit, left)
        log_path = os.path.join(self.work, f'{name}.log')
        entry = dict(name=name, command=shlex.join(cmd), log=os.path.relpath(log_path, self.scratch),
                     limit_s=round(limit), need_s=round(need))
        self.record['steps'].append(entry)
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
        try:
            passed, why = check()
        except Exception as e:  # a result that cannot be read is no pass
            passed, why = False, f'its result could not be read: {type(e).__name__}: {e}'[:500]
        if rc != 0:
            passed, why = False, ('stopped at its time limit' if rc == 124 else f'exit code {rc}') + f'; {why}'
        entry.update(ok=bool(passed), status='passed' if passed else 'failed', why=why)
        with open(log_path, errors='replace') as f:
            text = f.read()
        if not passed:
            entry['tail'] = text[-3000:]
        print(f'[gpu_check] {name}: {entry["status"]} ({why}), exit {rc} in {entry["seconds"]} s'
              + ('' if passed else '\n' + text[-1500:]), flush=True)
        return passed

    def path(self, *parts) -> str:
        return os.path.join(self.work, *parts)

    def finish(self) -> str:
        """Write ``gpu_check_<section>.json`` and ``gpu_check_<section>.tar.gz`` into ``out``."""
        steps = self.record['steps']
        self.record['seconds'] = round(time.time() - self.t0, 1)
        self.record['ok'] = all(s['ok'] is not False for s in steps)  # no step failed (steps not run: see not_run)
        self.record['passed'] = [s['name'] for s in steps if s['ok']]
        self.record['failed'] = [s['name'] for s in steps if s['ok'] is False]
        self.record['not_run'] = {s['name']: s['status'] for s in steps if s['ok'] is None}
        summary = os.path.join(self.out, f'gpu_check_{self.section}.json')
        with open(summary, 'w') as f:
            json.dump(self.record, f, indent=1, default=str)
        with tarfile.open(os.path.join(self.out, f'gpu_check_{self.section}.tar.gz'), 'w:gz') as tar:
            for p in sorted(glob.glob(os.path.join(self.work, '*'))):
                if p.endswith(('.log', '.json', '.xml', '.csv')):  # no checkpoints or images
                    tar.add(p, arcname=os.path.relpath(p, self.scratch))
        shutil.rmtree(self.scratch, ignore_errors=True)
        print(f'[gpu_check] {self.section}: {len(self.record["passed"])} steps passed, failed: '
              f'{self.record["failed"] or "none"}, not run: {self.record["not_run"] or "none"}; '
              f'{self.record["seconds"]} s; wrote {summary}', flush=True)
        return summary


# ----------------------------------------------------------------------------------------------------------
# what each step's own result says


def errors_in(x, where: str = '') -> list:
    """``'path: message'`` of every ``error`` or ``*_error`` string in a JSON value (the benchmarks record a case
    that failed so, and go on)."""
    out = []
    if isinstance(x, dict):
        for k, v in x.items():
            if (k == 'error' or str(k).endswith('_error')) and isinstance(v, str):
                out.append(f'{where}{k}: {v[:200]}')
            else:
                out += errors_in(v, f'{where}{k}.')
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += errors_in(v, f'{where}{i}.')
    return out


def check_json(path: str, need=None):
    """A check: ``path`` exists, holds no recorded error, and ``need(data)`` (a problem string, or None) is None."""
    def check():
        if not os.path.exists(path):
            return False, f'no result file {os.path.basename(path)}'
        with open(path) as f:
            data = json.load(f)
        if not data:
            return False, f'{os.path.basename(path)} is empty'
        errs = errors_in(data)
        if errs:
            return False, f'{len(errs)} recorded error(s): ' + '; '.join(errs[:3])
        problem = need(data) if need else None
        return (False, problem) if problem else (True, f'{os.path.basename(path)}: no errors')
    return check


def install(run: Run, args) -> None:
    """The bundle into this Python (offline); a dry run checks it and prints the commands."""
    bundle = args.bundle
    if bundle is None:
        run.record['results']['install'] = 'no bundle given: the installed packages are used'
        return
    record = run.path('install.json')
    cmd = [PY, os.path.join(TOOLS, 'gpu_bundle.py'), 'install', '--bundle', bundle, '--record', record]
    run.step('install', cmd + (['--dry-run'] if run.dry_run else []), 90,
             check_json(record, lambda r: None if r.get('ok') else 'the install did not finish'), need=30)
    if os.path.exists(record):
        with open(record) as f:
            run.record['results']['install'] = json.load(f)
    import importlib
    importlib.invalidate_caches()  # the packages just installed, for this process's imports


def pytest_step(run: Run, name: str, select: str, workers: int, limit: float, need: float) -> None:
    """``pytest -m cuda tests/test_cuda.py -k select``; passed when its JUnit XML counts tests, no failure or error,
    and on a GPU at least one test that ran."""
    xml = run.path(f'{name}.xml')
    cmd = [PY, '-m', 'pytest', '-p', 'no:cacheprovider', '-o', 'addopts=', '-m', 'cuda', 'tests/test_cuda.py',
           '-k', select, '-q', '--tb=short', '-rfE', f'--junitxml={xml}']
    if workers > 1:
        cmd += ['-n', str(workers)]

    def check():
        if not os.path.exists(xml):
            return False, 'no JUnit XML'
        c = junit_counts(xml)
        if not c['tests']:
            return False, 'no tests collected'
        if c['failures'] or c['errors']:
            return False, f"{c['failures']} failed, {c['errors']} errors: {', '.join(c['failed_tests'][:5])}"
        if not run.dry_run and not c['passed']:
            return False, f"all {c['tests']} tests skipped on a GPU"
        return True, f"{c['passed']} passed, {c['skipped']} skipped"
    run.step(name, cmd, limit, check, need)
    if os.path.exists(xml):
        run.record['results'][name] = junit_counts(xml)


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
                         served=r.get('served'),
                         shapes={k: dict(layer_ms=round(a, 3), conv_ms=round(c, 3), ratio=round(a / c, 2),
                                         layer_peak_mib=round(m, 1), conv_peak_mib=round(cm, 1))
                                 for k, a, c, m, cm in shapes},
                         ratio_summed=round(sum(x[1] for x in shapes) / sum(x[2] for x in shapes), 2)))
    return rows


def tc_kernels_summary(path: str) -> dict:
    """From benchmarks/tune_tc_kernels.py's JSON: each layer step's device time, its five largest kernels and the five
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




# ----------------------------------------------------------------------------------------------------------
# the steps' groups


def kernel_tests(run: Run, args) -> None:
    pytest_step(run, 'cuda_tests_kernels', KERNEL_TESTS, args.workers, 100, 60)


def layer_table(run: Run, args) -> None:
    """The layer against cuDNN's 3x3 conv at the three 1024 px shapes, and the batch-1 graph comparison."""
    table, graphs = run.path('layer_benchmarks.json'), run.path('graphs.json')

    def check():  # every table, then the batch-1 CUDA-graph comparison (graphs.json)
        passed, why = check_json(table)()
        return check_json(graphs)() if passed else (passed, why)
    run.step('layer_benchmarks', [PY, os.path.join(BENCHMARKS, 'benchmark_lambda_layer.py'), '--gpu-check', run.path()]
             + (['--tiny'] if run.dry_run else []), 80, check, need=40)
    if os.path.exists(table):  # what was measured, also where the step ran out of time
        run.record['results']['layer_vs_conv'] = layer_summary(table)
    if os.path.exists(graphs):
        with open(graphs) as f:
            run.record['results']['cuda_graphs_batch1'] = json.load(f)


# Mask R-CNN, Table 14's setting: (model, step, config without its '{amp}')
MASK_RCNN = [('lambdaresnet101', 'mmdet_train', 'mask-rcnn_lambdaresnet101_fpn_syncbn_{amp}lsj-130k_coco.py'),
             ('resnetrs101_se', 'mmdet_train_rs', 'mask-rcnn_resnetrs101_fpn_syncbn_{amp}lsj-130k_coco.py')]
MMDET_CLASSES = ('square', 'circle', 'triangle', 'star')


def mask_rcnn_setting(dry_run: bool) -> dict:
    """The Mask R-CNN steps' setting: Table 14's (1024 px, LSJ, AMP, 2 images a GPU), 5 warm-up and 30 timed
    iterations; in a dry run the same path at 64 px, fp32 (AMP needs a GPU), 1 + 2 iterations."""
    if dry_run:
        return dict(image_size=64, amp=False, batch=2, warmup=1, iterations=2, workers=0, light_heads=True)
    return dict(image_size=1024, amp=True, batch=2, warmup=5, iterations=30, workers=4, light_heads=False)


def mmdet_options(root: str, s: dict, checkpoint: bool) -> list:
    """``--cfg-options`` of tools/train.py for the generated set: the config's pipeline at ``image_size`` (LSJ kept),
    ``warmup + iterations`` iterations, each logged unsmoothed (time, data time, peak memory), no evaluation, and a
    checkpoint at the end only where ``checkpoint``."""
    from timm_lambda_mmdet.overrides import small_run_overrides, to_cli_options
    iters = s['warmup'] + s['iterations']
    o = small_run_overrides(root, image_size=s['image_size'], max_iters=iters, batch_size=s['batch'],
                            num_workers=s['workers'], classes=MMDET_CLASSES, num_classes=len(MMDET_CLASSES),
                            validate=False, light_heads=s['light_heads'],
                            checkpoint_interval=iters if checkpoint else iters + 1)
    o['log_processor.window_size'] = 1  # each iteration's own time in scalars.json (default: a mean over 10)
    if not checkpoint:
        o['default_hooks.checkpoint.save_last'] = False
    return to_cli_options(o)


def mmdet_timing(work: str, warmup: int) -> dict:
    """From mmengine's ``vis_data/scalars.json`` (logged every iteration): the iterations logged, first and last
    loss, the median and mean seconds an iteration and of its data loading after ``warmup`` iterations, and the peak
    GPU memory (mmengine's ``memory``: ``max_memory_allocated`` in MiB since the last log; None on a CPU)."""
    rows = []
    for path in glob.glob(os.path.join(work, '*', 'vis_data', 'scalars.json')):
        with open(path) as f:
            rows += [r for r in map(json.loads, f) if 'loss' in r and 'iter' in r]
    if not rows:
        return {}
    rows.sort(key=lambda r: r['iter'])
    timed = [r for r in rows if r['iter'] > warmup] or rows
    times = [r['time'] for r in timed if 'time' in r]
    data = [r['data_time'] for r in timed if 'data_time' in r]
    memory = [r['memory'] for r in rows if 'memory' in r]
    return dict(logged=len(rows), last_iter=rows[-1]['iter'], timed_iterations=len(times),
                loss_first=rows[0]['loss'], loss_last=rows[-1]['loss'],
                s_per_iter=round(statistics.median(times), 4) if times else None,
                s_per_iter_mean=round(statistics.mean(times), 4) if times else None,
                data_s_per_iter=round(statistics.median(data), 4) if data else None,
                peak_memory_mib=max(memory) if memory else None)


def mask_rcnn(run: Run, args) -> None:
    """Mask R-CNN in Table 14's setting (:func:`mask_rcnn_setting`) with mmdet's own tools/train.py on a generated
    COCO-format set: LambdaResNet-101 and ResNet-RS-101+SE side by side (seconds an iteration, peak memory), then
    tools/test.py on the LambdaResNet-101 checkpoint."""
    import mmdet

    from _lib.synthetic_coco import make_coco_dataset
    from timm_lambda_mmdet.overrides import small_run_overrides, to_cli_options
    tools = os.path.join(os.path.dirname(mmdet.__file__), '.mim', 'tools')
    s = mask_rcnn_setting(run.dry_run)
    iters = s['warmup'] + s['iterations']
    root = run.path('coco')
    make_coco_dataset(root, num_train=4 if run.dry_run else 16, num_val=2 if run.dry_run else 8,
                      image_size=s['image_size'], seed=3)
    res = run.record['results']['mask_rcnn'] = dict(setting=s, models={})
    for model, name, config in MASK_RCNN:
        config = os.path.join(ROOT, 'configs', 'mmdet', config.format(amp='amp-' if s['amp'] else ''))
        work = run.path(name)
        first = model == MASK_RCNN[0][0]  # its checkpoint for tools/test.py

        def check(work=work, first=first):
            t = mmdet_timing(work, s['warmup'])
            if not t:
                return False, 'no training loss logged (vis_data/scalars.json)'
            if t['last_iter'] != iters:
                return False, f"logged up to iteration {t['last_iter']} of {iters}"
            if not math.isfinite(t['loss_last']):
                return False, f"loss {t['loss_last']}"
            if not run.dry_run and t['peak_memory_mib'] is None:
                return False, 'no peak memory logged on a GPU'
            if first and not os.path.exists(os.path.join(work, f'iter_{iters}.pth')):
                return False, f'no checkpoint iter_{iters}.pth'
            return True, f"{iters} iterations, {t['s_per_iter']} s an iteration"
        run.step(name, [PY, os.path.join(tools, 'train.py'), config, '--work-dir', work, '--cfg-options']
                 + mmdet_options(root, s, checkpoint=first), 130 if first else 110, check, need=70 if first else 60)
        res['models'][model] = dict(config=os.path.relpath(config, ROOT), **mmdet_timing(work, s['warmup']))
    lam, rs = (res['models'][m[0]] for m in MASK_RCNN)
    for key in ('s_per_iter', 'peak_memory_mib'):
        if lam.get(key) and rs.get(key):
            res[f'{key}_lambda_over_rs'] = round(lam[key] / rs[key], 3)
    config = os.path.join(ROOT, lam['config'])
    ckpt, test_dir = os.path.join(run.path(MASK_RCNN[0][1]), f'iter_{iters}.pth'), run.path('mmdet_test')

    def check_test():
        m = _mmdet_metrics(test_dir)
        ok = all(isinstance(m.get(k), float) for k in ('coco/bbox_mAP', 'coco/segm_mAP'))
        return ok, 'bbox and segm AP' if ok else f'no bbox and segm AP in the test log: {m}'
    if os.path.exists(ckpt):
        run.step('mmdet_test', [PY, os.path.join(tools, 'test.py'), config, ckpt, '--work-dir', test_dir,
                                '--cfg-options'] + to_cli_options(small_run_overrides(
                                    root, image_size=s['image_size'], classes=MMDET_CLASSES,
                                    num_classes=len(MMDET_CLASSES), light_heads=s['light_heads'])), 60, check_test,
                 need=35)
        res['metrics'] = _mmdet_metrics(test_dir)
    else:
        run.not_run('mmdet_test', f'no checkpoint from {MASK_RCNN[0][1]}')
    for d in [run.path(m[1]) for m in MASK_RCNN] + [test_dir]:  # checkpoints and images stay behind; logs packed
        for p in glob.glob(os.path.join(d, '**', '*.json'), recursive=True) + \
                glob.glob(os.path.join(d, '**', '*.log'), recursive=True):
            shutil.copy(p, run.path(f'{os.path.basename(d)}_{os.path.basename(p)}'))


def _mmdet_metrics(test_dir: str) -> dict:
    for path in sorted(glob.glob(os.path.join(test_dir, '*', '*.json'))):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if 'coco/bbox_mAP' in rec:
                    return {k: v for k, v in rec.items() if k.startswith('coco/')}
    return {}


def image_folder(root: str, classes, per_class: int, size: int) -> None:
    """A generated ImageFolder (``root/train/<class>/*.png``, ``root/val/...``) from _lib.datasets.SyntheticShapes."""
    from _lib.datasets import SyntheticShapes
    n = per_class * len(classes)
    for split, n in (('train', n), ('val', max(len(classes), n // 4))):
        data = SyntheticShapes(n, size, classes=classes, split=split, seed=0)
        for i in range(len(data)):
            img, label = data[i]
            d = os.path.join(root, split, classes[label])
            os.makedirs(d, exist_ok=True)
            img.save(os.path.join(d, f'{i:04d}.png'))




def timm_scripts(run: Run, args) -> None:
    """timm's own train.py (2 epochs, --amp, --channels-last) and validate.py on LambdaResNet-50 (registered in timm
    by the autoload hook: no change to the scripts)."""
    scripts = os.path.join(args.bundle, 'timm_scripts') if args.bundle else os.environ.get('TIMM_SCRIPTS')
    res = run.record['results'].setdefault('timm_scripts', {})
    if not scripts or not os.path.isfile(os.path.join(scripts, 'train.py')):
        res['note'] = 'timm\'s scripts not found: --bundle (timm_scripts/) or TIMM_SCRIPTS=<folder with train.py>'
        run.not_run('timm_train', res['note'])
        run.not_run('timm_validate', res['note'])
        return
    manifest = os.path.join(args.bundle or '', 'MANIFEST.json')
    if args.bundle and os.path.exists(manifest):  # the tag and commit they were taken from (gpu_bundle.py build)
        with open(manifest) as f:
            res['scripts_from'] = json.load(f).get('timm_scripts_from')
    classes = ('disc', 'triangle', 'checker', 'v_stripes')
    size, epochs = (32 if run.dry_run else 128), 2
    data = run.path('imagefolder')
    image_folder(data, classes, 4 if run.dry_run else 64, size)
    out = run.path('timm_train')
    common = ['--model', 'lambdaresnet50', '--num-classes', str(len(classes)), '--img-size', str(size), '--amp',
              '--channels-last', '--workers', '2']
    cpu = ['--device', 'cpu', '--no-prefetcher', '--amp-dtype', 'bfloat16'] if run.dry_run else []
    summary, ckpt = os.path.join(out, 'run', 'summary.csv'), os.path.join(out, 'run', 'last.pth.tar')

    def check_train():
        if not os.path.exists(summary):
            return False, 'no summary.csv'
        with open(summary) as f:
            rows = f.read().strip().splitlines()[1:]
        if len(rows) < epochs:
            return False, f'{len(rows)} of {epochs} epochs in summary.csv'
        return os.path.exists(ckpt), f'{len(rows)} epochs' + ('' if os.path.exists(ckpt) else ', no last.pth.tar')
    run.step('timm_train', [PY, os.path.join(scripts, 'train.py'), '--data-dir', data, '--train-split', 'train',
                            '--val-split', 'val', '-b', '8' if run.dry_run else '32', '--epochs', str(epochs),
                            '--warmup-epochs', '0', '--lr', '0.02', '--output', out, '--experiment', 'run',
                            '--log-interval', '1', '--checkpoint-hist', '1'] + common + cpu, 80, check_train, need=45)
    if os.path.exists(summary):
        shutil.copy(summary, run.path('timm_train_summary.csv'))
        with open(summary) as f:
            res['summary_csv'] = f.read().strip().splitlines()
    results_file = run.path('timm_validate.json')
    if not os.path.exists(ckpt):
        return run.not_run('timm_validate', 'no checkpoint from timm_train')
    run.step('timm_validate', [PY, os.path.join(scripts, 'validate.py'), '--data-dir', data, '--split', 'val',
                               '--checkpoint', ckpt, '-b', '16', '--results-file', results_file,
                               '--results-format', 'json'] + common + cpu, 40,
             check_json(results_file, lambda r: None if isinstance(r.get('top1'), (int, float)) else 'no top1'),
             need=20)
    if os.path.exists(results_file):
        with open(results_file) as f:
            res['validate'] = json.load(f)


def tc_kernels(run: Run, args) -> None:
    """Where a layer step's GPU time goes and the tensor-core kernels' tiles, warps and stages (the tool stops itself
    at its budget and keeps what it measured)."""
    # the tool stops between measurements: 15 s to finish one on a GPU; under the interpreter on a shared CPU one
    # takes a minute or more (the step's limit there 4 x 115 s, the tool's budget 385 s as before)
    limit, need = (115, 45) if run.dry_run else (100, 45)
    budget = min(limit, run.left() - RESERVE) - 15 if not run.dry_run else 385
    path = run.path('tune_tc_kernels.json')

    def check():
        """Finished, with rows; no error at the wrappers' own constants (each sweep's and occupancy row's first
        config) or in the profile and host rows. An alternative tiling that fails to compile or differs is a finding
        of the sweep, counted in ``why``."""
        if not os.path.exists(path):
            return False, 'no tune_tc_kernels.json'
        with open(path) as f:
            record = json.load(f)
        rows = record.get('rows') or []
        if not rows or 'complete' not in record:
            return False, f'{len(rows)} rows, not finished'
        shipped = [r for r in rows if r['part'] not in ('sweep', 'occupancy')] + [
            (r.get('configs') or [{}])[0] for r in rows if r['part'] in ('sweep', 'occupancy')]
        errs = errors_in(shipped)
        if errs:
            return False, f'{len(errs)} error(s) at the wrappers\' constants: ' + '; '.join(errs[:3])
        alternatives = len(errors_in(rows))
        return True, f'{len(rows)} rows' + (f'; {alternatives} alternative tilings failed or differed'
                                            if alternatives else '')
    run.step('tune_tc_kernels', [PY, os.path.join(BENCHMARKS, 'tune_tc_kernels.py'), '--out', run.path(), '--budget',
                                 str(round(max(budget, 5)))] + (['--dry-run'] if run.dry_run else []), limit,
             check, need=need)
    if os.path.exists(path):
        run.record['results']['tc_kernels'] = tc_kernels_summary(path)


MODEL_BENCHMARKS = [  # name, arguments (GPU), arguments (dry run), limit, need (seconds on a GPU)
    ('models_graphs', ['graphs', '--device', 'cuda', '--repeats', '15'],
     ['graphs', '--device', 'cpu', '--sizes', '64', '--repeats', '1'], 55, 35),
    ('models_backbone_b1', ['backbone', '--device', 'cuda', '--repeats', '10'],
     ['backbone', '--sizes', '64', '--repeats', '1'], 60, 40),  # (run 5: stopped at 22 s)
    ('models_c4', ['c4', '--device', 'cuda', '--repeats', '10'], ['c4', '--sizes', '64', '--repeats', '1'], 45, 30),
    ('models_cuda', ['cuda', '--repeats', '10'],
     ['cuda', '--device', 'cpu', '--sizes', '64', '32', '--batch', '1', '--classifier-batch', '2', '--repeats', '1'],
     70, 45),
    # last: CUDA graphs by hand against torch.compile(mode='reduce-overhead') for the detection backbone (issue 37)
    ('models_reduce_overhead', ['graphs', '--device', 'cuda', '--repeats', '10', '--reduce-overhead'],
     ['graphs', '--device', 'cpu', '--sizes', '64', '--repeats', '1', '--reduce-overhead'], 200, 170),
]


def model_benchmarks(run: Run, which) -> None:
    """``benchmark_models.py`` comparisons; each passed when each comparison of its JSON has rows or times and no
    recorded error (a compiled step that fails is recorded as ``compiled_error``: a failed step)."""
    res = run.record['results'].setdefault('models', {})
    for name, gpu, dry, limit, need in which:
        path = run.path(f'{name}.json')
        run.step(name, [PY, os.path.join(BENCHMARKS, 'benchmark_models.py')] + (dry if run.dry_run else gpu)
                 + ['--json', path], limit,
                 check_json(path, lambda r: None if all(c.get('rows') or c.get('times') for c in r)
                            else 'a comparison without rows or times'),
                 need=need)
        if os.path.exists(path):
            with open(path) as f:
                res[name] = json.load(f)


def model_tests(run: Run, args) -> None:
    pytest_step(run, 'cuda_tests_models', MODEL_TESTS, args.workers, 100, 90)


def layer_models(run: Run, args) -> None:
    model_benchmarks(run, MODEL_BENCHMARKS[:2])


def mission_models(run: Run, args) -> None:
    model_benchmarks(run, MODEL_BENCHMARKS[2:])


# the steps' groups of each section, in order of value; ``all`` is ``layer`` and ``mission`` together
SECTIONS = {
    'all': [install, kernel_tests, layer_table, mask_rcnn, timm_scripts, tc_kernels, layer_models, mission_models,
            model_tests],
    'layer': [install, kernel_tests, layer_table, tc_kernels, layer_models],
    'mission': [install, mask_rcnn, timm_scripts, mission_models, model_tests],
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('section', nargs='?', default='all', choices=list(SECTIONS),
                   help='all (default: one command for a 15-minute slot), or its first (layer) or second half')
    p.add_argument('--bundle', default=None, help='the offline bundle folder (tools/gpu_bundle.py build)')
    p.add_argument('--out', default='work_dirs/gpu_check', help='where the two result files go')
    p.add_argument('--budget', type=float, default=None,
                   help=f'seconds for the whole section (default: {BUDGET} on a GPU, none in a dry run)')
    p.add_argument('--workers', type=int, default=None, help='pytest-xdist workers (default: cores / 2, at most 8)')
    p.add_argument('--skip', default='', help='comma-separated step names not to run (a short slot: the steps '
                   'measured before), e.g. cuda_tests_models,timm_train')
    p.add_argument('--dry-run', action='store_true', help='CPU, tiny sizes: every step starts and writes its output')
    args = p.parse_args(argv)
    if args.workers is None:
        args.workers = 1 if args.dry_run else min(8, max(1, (os.cpu_count() or 2) // 2))
    if args.budget is None and not args.dry_run:
        args.budget = BUDGET
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit('gpu_check: no CUDA device (torch.cuda.is_available() is False); --dry-run runs the steps '
                         'on the CPU')
    if args.bundle:
        args.bundle = os.path.abspath(args.bundle)
    run = Run(args.section, args.out, args.budget, args.dry_run, argv, skip=[x for x in args.skip.split(',') if x])
    for group in SECTIONS[args.section]:
        group(run, args)
    summary = run.finish()
    if run.record['failed']:
        raise SystemExit(1)
    return summary


if __name__ == '__main__':
    main()
