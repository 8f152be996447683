"""The GPU check (tools/gpu_check.py) and its offline bundle (tools/gpu_bundle.py) cannot rot between GPU runs: its
two halves run here on the CPU at tiny sizes (``--dry-run``), every step starting and writing its output; the bundle
is built with pip and git stood in for (they would need the network) and checked the way the GPU machine installs
it. timm's train.py and validate.py are not in timm's wheel or sdist: the mission's timm step runs where
``TIMM_SCRIPTS`` names a folder holding them, and otherwise records that it did not."""
import json
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, 'tools', 'gpu_check.py')
BUNDLE = os.path.join(ROOT, 'tools', 'gpu_bundle.py')
sys.path.insert(0, os.path.join(ROOT, 'tools'))
import gpu_bundle  # noqa: E402


def _run(args, timeout=900, **env):
    return subprocess.run([sys.executable] + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **env))


def _wheel(path):
    with zipfile.ZipFile(path, 'w') as z:
        z.writestr('placeholder.txt', os.path.basename(path))


def test_bundle_builds_offline_parts_and_installs_only_what_matches_its_manifest(tmp_path):
    """``build``: pip's downloads (stood in for by a script that writes a wheel per requirement, recording its
    arguments), the mmcv wheel from a folder named for the target, timm's scripts from a clone's tag; MANIFEST.json
    names every file with its sha256. ``install --dry-run``: the pip commands are --no-index; a file that differs from
    the manifest stops it, naming the file."""
    fake_pip = tmp_path / 'pip.py'
    fake_pip.write_text('import json, os, sys\nargs = sys.argv[1:]\nout = args[args.index("-d") + 1]\n'
                        'json.dump(args, open(os.path.join(out, "..", "pip_args.json"), "w"))\n'
                        'for r in args:\n    if "==" in r:\n        n, v = r.split("==")\n'
                        '        name = n.replace("-", "_") + "-" + v + "-py3-none-any.whl"\n'
                        '        open(os.path.join(out, name), "w").close()\n')
    links = tmp_path / 'links' / 'cp312-torch2.11.0-cu130-sm90'
    links.mkdir(parents=True)
    _wheel(links / 'mmcv-2.1.0-cp312-cp312-linux_x86_64.whl')
    repo = _timm_clone(tmp_path / 'timm', f"v{gpu_bundle.pins()['timm']}")
    out = tmp_path / 'bundle'
    r = _run([BUNDLE, 'build', '--out', str(out), '--pip', f'{sys.executable} {fake_pip}', '--find-links',
              str(tmp_path / 'links'), '--timm-repo', str(repo)])
    assert r.returncode == 0, r.stderr[-3000:]
    args = json.loads((out / 'pip_args.json').read_text())
    assert args[:2] == ['download', '--no-deps'] and '--only-binary=:all:' in args and 'cp312' in args
    pins = gpu_bundle.pins()
    assert {a for a in args if '==' in a} == {f'{p}=={pins[p]}' for p in gpu_bundle.PACKAGES}
    manifest = json.loads((out / 'MANIFEST.json').read_text())
    assert 'wheels/mmcv-2.1.0-cp312-cp312-linux_x86_64.whl' in manifest['files']
    assert {f'timm_scripts/{n}' for n in gpu_bundle.TIMM_SCRIPTS} <= set(manifest['files'])
    assert manifest['target'] == dict(python='3.12', torch='2.11.0+cu130', cuda_arch='9.0')
    assert f"v{pins['timm']}" in manifest['timm_scripts_from']
    r = _run([BUNDLE, 'install', '--bundle', str(out), '--dry-run', '--record', str(tmp_path / 'install.json')])
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / 'install.json').read_text())['ok'] is True  # what the GPU check's install step reads
    assert '--no-index' in r.stderr and f'--force-reinstall {ROOT}' in r.stderr  # this checkout, offline
    installed = [w for w in manifest['files'] if w.endswith('.whl') and w.split('/')[1] in r.stderr]
    assert all(gpu_bundle.wheel_dist(w)[1] != _version(gpu_bundle.wheel_dist(w)[0]) for w in installed), installed
    (out / 'timm_scripts' / 'train.py').write_text('changed\n')
    r = _run([BUNDLE, 'install', '--bundle', str(out), '--dry-run'])
    assert r.returncode != 0 and 'timm_scripts/train.py does not match MANIFEST.json' in r.stderr


def _timm_clone(path, tag=None):
    """A git repository holding timm's scripts, tagged ``tag`` where given."""
    path.mkdir()
    for name in gpu_bundle.TIMM_SCRIPTS:
        (path / name).write_text(f'# {name}\n')
    git = ['git', '-C', str(path), '-c', 'user.name=t', '-c', 'user.email=t@t']
    subprocess.run(git[:3] + ['init', '-q'], check=True)
    subprocess.run(git + ['add', '.'], check=True)
    subprocess.run(git + ['commit', '-qm', 'scripts'], check=True)
    if tag:
        subprocess.run(git + ['tag', tag], check=True)
    return path


def test_bundle_takes_timm_scripts_from_the_pinned_tag_or_fails_naming_it(tmp_path):
    """A clone without the pinned tag (once: its checked-out scripts, silently another timm's) and a plain folder are
    errors that name the tag; with the tag, the scripts are the tag's, not the checked-out tree's."""
    tag = f"v{gpu_bundle.pins()['timm']}"
    with pytest.raises(SystemExit, match=f'no tag {tag}'):
        gpu_bundle.timm_scripts(str(tmp_path / 'out'), tag[1:], str(_timm_clone(tmp_path / 'untagged')))
    plain = tmp_path / 'plain'
    plain.mkdir()
    (plain / 'train.py').write_text('# train\n')
    with pytest.raises(SystemExit, match=tag):
        gpu_bundle.timm_scripts(str(tmp_path / 'out'), tag[1:], str(plain))
    repo = _timm_clone(tmp_path / 'tagged', tag)
    (repo / 'train.py').write_text('# after the tag\n')  # the checked-out tree differs from the tag
    where = gpu_bundle.timm_scripts(str(tmp_path / 'out'), tag[1:], str(repo))
    assert tag in where and (tmp_path / 'out' / 'train.py').read_text() == '# train.py\n'
    # another ref only where the caller names it, and recorded as not the pinned tag
    where = gpu_bundle.timm_scripts(str(tmp_path / 'out2'), tag[1:], str(_timm_clone(tmp_path / 'other')), 'HEAD')
    assert f'NOT the pinned tag {tag}' in where and (tmp_path / 'out2' / 'train.py').exists()


def test_bundle_without_timm_scripts_leaves_them_out_of_its_manifest(tmp_path):
    """``--no-timm-scripts`` (no clone with the pinned tag where the bundle is built): a bundle whose manifest names no
    script, so that the GPU check records timm's steps as not run."""
    links = tmp_path / 'links' / 'cp312-torch2.11.0-cu130-sm90'
    links.mkdir(parents=True)
    _wheel(links / 'mmcv-2.1.0-cp312-cp312-linux_x86_64.whl')
    out = tmp_path / 'bundle'
    r = _run([BUNDLE, 'build', '--out', str(out), '--pip', f'{sys.executable} -c pass', '--find-links',
              str(tmp_path / 'links'), '--no-timm-scripts'])
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((out / 'MANIFEST.json').read_text())
    assert manifest['timm_scripts_from'] is None and not any(f.startswith('timm_scripts/') for f in manifest['files'])


def _version(name):
    import importlib.metadata as md
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def test_bundle_build_without_an_mmcv_wheel_names_the_remedies(tmp_path):
    r = _run([BUNDLE, 'build', '--out', str(tmp_path / 'b'), '--pip', f'{sys.executable} -c pass', '--find-links',
              str(tmp_path), '--torch', '2.99.0+cu139'], PIP_FIND_LINKS='')
    assert r.returncode != 0
    assert 'cp312-torch2.99.0-cu139-sm90' in r.stderr and '--build-mmcv' in r.stderr and '--mmcv-wheel' in r.stderr


def _check_outputs(out, section):
    with open(os.path.join(out, f'gpu_check_{section}.json')) as f:
        record = json.load(f)
    for key in ('command', 'date', 'commit', 'machine', 'steps', 'results'):
        assert key in record, key
    assert record['dry_run'] and record['machine']['gpu'] is None
    for key in ('torch', 'triton', 'driver'):
        assert key in record['machine'], key
    failed = [s for s in record['steps'] if s['ok'] is False or s.get('rc') not in (0, None)]
    assert not failed, failed
    assert record['ok'] and not record['failed']
    # a step is ok from its own result, and each that ran says what it read
    assert all(s['status'] == 'passed' and s['why'] for s in record['steps'] if s['rc'] is not None)
    with tarfile.open(os.path.join(out, f'gpu_check_{section}.tar.gz')) as tar:
        names = tar.getnames()
    for s in record['steps']:
        if s.get('rc') == 0:
            assert s['log'] in names, s['log']
    return record, names


@pytest.mark.slow
def test_gpu_check_layer_dry_run(tmp_path):
    """Command 1 on the CPU: the CUDA kernel tests collected (and skipped here), the layer against the conv for every
    execution, dtype and mode, the batch-1 graph comparison, the backbone comparison."""
    r = _run([TOOL, 'layer', '--dry-run', '--out', str(tmp_path)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    record, names = _check_outputs(str(tmp_path), 'layer')
    assert [s['name'] for s in record['steps']] == ['cuda_tests_kernels', 'layer_benchmarks', 'tune_tc_kernels',
                                                    'models_graphs', 'models_backbone_b1']
    assert all(s['rc'] == 0 for s in record['steps'])
    tests = record['results']['cuda_tests_kernels']
    assert tests['tests'] > 200 and tests['skipped'] == tests['tests']  # no CUDA here
    rows = record['results']['layer_vs_conv']
    assert {r['execution'] for r in rows} == {'triton_tc', 'gemm', 'triton_fma'}
    assert {(r['dtype'], r['mode']) for r in rows if r['execution'] == 'triton_tc'} == {
        (d, m) for d in ('float32', 'bfloat16') for m in ('train', 'eval')}
    assert all(len(r['shapes']) == 3 and r['ratio_summed'] > 0 for r in rows)
    tc = record['results']['tc_kernels']  # the step's profile rows and its sweep, each alternative equal to the default
    assert {(p['shape'], p['module']) for p in tc['profile']} == {(s, m) for s in ('c4', 'c5_s2')
                                                                  for m in ('lambda', 'conv3x3')}
    assert all(any(k.startswith('aten::') and '[' in k for k in p['top_ops']) for p in tc['profile']), tc['profile']
    assert all(p['wall_us'] > 0 and p['host_cpu_us'] > 0 for p in tc['profile']), tc['profile']
    assert len(tc['sweep']) == 6 and all(s['errors'] == 0 for s in tc['sweep']), tc['sweep']
    # each kernel against another tiling; at stride 1 the rows kernels also against the GEMM path they replace
    # (logits, dq; the value gradient reads the logits GEMM's tensor since issue 53)
    assert [s['configs'] for s in tc['sweep']] == [3, 3, 2, 2, 2, 2], tc['sweep']
    assert set(tc['host_us_per_call']) == {'aten add', 'aten bmm 4x8x8', 'triton tc_rows launch',
                                           'lambda layer training step 2x2', 'conv3x3 training step 2x2'}, tc
    assert all(v > 0 for v in tc['host_us_per_call'].values()), tc['host_us_per_call']
    # where the layer step's own host time goes, by function (cProfile), largest first
    top = list(tc['host_python_top'].values())
    assert len(top) == 8 and top == sorted(top, reverse=True) and top[0] > 0, tc['host_python_top']
    assert any('lambda_layer.py' in k for k in tc['host_python_top']) or any(
        'backward' in k for k in tc['host_python_top']), tc['host_python_top']
    # batch 1: the small-grid tiles against the full-grid ones where they differ (at the tiny shapes, on 132 SMs)
    assert tc['occupancy'] and all(o['errors'] == 0 and len(o['ms']) == 2 for o in tc['occupancy']), tc['occupancy']
    graphs = record['results']['cuda_graphs_batch1']
    assert len(graphs) == 6 and all('eager_ms' in g for g in graphs), graphs
    rows = record['results']['models']['models_graphs'][0]['rows']
    assert len(rows) == 4 and all('eager_ms' in r for r in rows), rows
    assert {'models_graphs', 'models_backbone_b1'} <= set(record['results']['models'])
    assert 'layer_files/layer_benchmarks.json' in names


@pytest.mark.slow
def test_gpu_check_mission_dry_run(tmp_path):
    """Command 2 on the CPU: the model tests collected, Mask R-CNN through mmdet's tools/train.py and tools/test.py
    (bbox and segm AP from pycocotools), timm's train.py and validate.py where TIMM_SCRIPTS has them, the model
    comparisons, hand-made CUDA graphs against torch.compile(mode='reduce-overhead')."""
    r = _run([TOOL, 'mission', '--dry-run', '--out', str(tmp_path)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    record, names = _check_outputs(str(tmp_path), 'mission')
    res = record['results']
    steps = {s['name']: s for s in record['steps']}
    assert [n for n in steps if n.startswith('mmdet')] == ['mmdet_train', 'mmdet_train_rs', 'mmdet_test']
    assert all(steps[n]['ok'] for n in ('mmdet_train', 'mmdet_train_rs', 'mmdet_test'))
    mask = res['mask_rcnn']  # the two backbones side by side, Table 14's config through mmdet's tools/train.py
    assert mask['setting']['iterations'] == 2 and mask['setting']['batch'] == 2
    assert [m['config'] for m in mask['models'].values()] == [
        'configs/mmdet/mask-rcnn_lambdaresnet101_fpn_syncbn_lsj-130k_coco.py',
        'configs/mmdet/mask-rcnn_resnetrs101_fpn_syncbn_lsj-130k_coco.py']
    for m in mask['models'].values():
        assert m['last_iter'] == 3 and m['timed_iterations'] == 2 and m['s_per_iter'] > 0, m
    assert mask['s_per_iter_lambda_over_rs'] > 0
    for k in ('coco/bbox_mAP', 'coco/segm_mAP'):
        assert isinstance(mask['metrics'][k], float), mask
    if os.environ.get('TIMM_SCRIPTS'):
        assert steps['timm_train']['ok'] and 'top1' in res['timm_scripts']['validate']
    else:
        assert 'not found' in res['timm_scripts']['note']
        assert steps['timm_train']['status'].startswith('not run: ') and steps['timm_train']['ok'] is None
    assert set(res['models']) == {'models_c4', 'models_cuda', 'models_reduce_overhead'}
    row, = res['models']['models_reduce_overhead'][0]['rows']  # eager standing in for the compiled step on a CPU
    assert {'eager_ms', 'graphed_ms', 'compiled_ms', 'ratio_compiled', 'compile_and_capture_s'} <= set(row), row


def test_gpu_check_skip_records_the_step_without_running_it(tmp_path):
    """``--skip NAME``: the step is recorded as not run, its command never starts, and the section still counts as ok
    (a short slot leaves out the steps measured before)."""
    import gpu_check
    run = gpu_check.Run('layer', str(tmp_path / 'out'), None, dry_run=True, argv=[], skip=['made'])
    marker = tmp_path / 'marker'
    touch = [sys.executable, '-c', f'open({str(marker)!r}, "w").close()']
    assert not run.step('made', touch, 10, lambda: (marker.exists(), 'marker')) and not marker.exists()
    assert run.step('kept', touch, 10, lambda: (marker.exists(), 'marker')) and marker.exists()
    assert [(s['name'], s['status']) for s in run.record['steps']] == [('made', 'not run: --skip'),
                                                                       ('kept', 'passed')]
    with open(run.finish()) as f:
        assert json.load(f)['ok'] is True


def test_gpu_check_step_ok_from_its_result_and_budget(tmp_path):
    """A step that exits 0 without the result its check wants has failed (run 5's reduce-overhead step exited 0 with
    its compiled step failed); a recorded error fails a step; one that the budget no longer fits is 'not run:
    budget', the summary is written all the same, and the command would exit 1 for the failed steps."""
    import gpu_check
    run = gpu_check.Run('all', str(tmp_path / 'out'), 60, dry_run=False, argv=['all'])
    result = tmp_path / 'r.json'
    write = [sys.executable, '-c', f'import json; json.dump([dict(rows=[dict(compiled_error="boom")])], '
             f'open({str(result)!r}, "w"))']
    assert not run.step('no_result', [sys.executable, '-c', 'pass'], 20, gpu_check.check_json(str(tmp_path / 'x')),
                        need=1)
    assert not run.step('recorded_error', write, 20, gpu_check.check_json(str(result)), need=1)
    assert run.step('too_long', [sys.executable, '-c', 'pass'], 200, lambda: (True, ''), need=100) is None
    steps = {s['name']: s for s in run.record['steps']}
    assert steps['no_result']['rc'] == 0 and steps['no_result']['status'] == 'failed'
    assert 'no result file x' in steps['no_result']['why']
    assert 'compiled_error: boom' in steps['recorded_error']['why']
    assert steps['too_long']['status'] == 'not run: budget' and steps['too_long']['ok'] is None
    with open(run.finish()) as f:
        summary = json.load(f)
    assert summary['ok'] is False and summary['failed'] == ['no_result', 'recorded_error']
    assert summary['not_run'] == {'too_long': 'not run: budget'} and summary['budget_s'] == 60
    assert summary['machine']['gpu'] is None and {'triton', 'torch', 'driver'} <= set(summary['machine'])
    assert summary['commit'] != 'unknown'  # (with '+dirty' where tracked files differ)


def test_gpu_check_all_is_both_halves_in_order_of_value():
    """The one command for a 15-minute slot runs every step of the two halves (which CI dry-runs), kernel tests
    first, then the layer table, Mask R-CNN, timm's scripts, the comparisons, the model tests last; its default
    budget fits a 600 s command with time to pack."""
    import gpu_check
    sections = {k: [f.__name__ for f in v] for k, v in gpu_check.SECTIONS.items()}
    assert set(sections['all']) == set(sections['layer']) | set(sections['mission'])
    assert sections['all'][:5] == ['install', 'kernel_tests', 'layer_table', 'mask_rcnn', 'timm_scripts']
    assert sections['all'][-1] == 'model_tests'
    assert gpu_check.BUDGET + 30 <= 600
    setting = gpu_check.mask_rcnn_setting(dry_run=False)  # the mission's own setting, not a smoke test
    assert (setting['image_size'], setting['amp'], setting['batch'], setting['iterations']) == (1024, True, 2, 30)


def test_mask_rcnn_timing_from_mmengines_log(tmp_path):
    """Seconds an iteration: the median of mmengine's per-iteration ``time`` after the warm-up; peak memory: the
    largest ``memory`` (MiB) logged; the options log every iteration unsmoothed and keep the config's LSJ pipeline."""
    import gpu_check
    vis = tmp_path / '20261129_000000' / 'vis_data'
    vis.mkdir(parents=True)
    rows = [dict(iter=i, loss=2.0 - i / 10, time=9.0 if i <= 2 else 0.3 + i / 100, data_time=0.01, memory=1000 + i)
            for i in range(1, 8)]
    (vis / 'scalars.json').write_text('\n'.join(json.dumps(r) for r in rows) + '\n')
    t = gpu_check.mmdet_timing(str(tmp_path), warmup=2)
    assert (t['last_iter'], t['timed_iterations'], t['s_per_iter'], t['peak_memory_mib']) == (7, 5, 0.35, 1007), t
    options = gpu_check.mmdet_options(str(tmp_path), gpu_check.mask_rcnn_setting(dry_run=False), checkpoint=False)
    assert 'log_processor.window_size=1' in options and 'train_cfg.max_iters=35' in options
    assert 'train_dataloader.dataset.pipeline.2.scale=(1024,1024)' in options  # LSJ's RandomResize at 1024
    assert 'default_hooks.checkpoint.save_last=False' in options and 'train_dataloader.batch_size=2' in options
