"""The result figures of README.md and docs/ against the JSON they come from (docs/results/), and the README's and
docs' sizes.

Each entry of :data:`FIGURES` is a passage of a page with ``{}`` where a figure stands, the JSON it comes from and
how the figures follow from it (ratios of medians, as tools/dev/benchmarks/measure.py prints them). The passage must
be on the page once, and each figure must be the JSON's value rounded to the figure's digits: a figure edited by
hand, or a passage rewritten without its entry here, fails. Figures of earlier runs are read from the JSON's git
history (``at_commit``; skipped where there is none). A figure whose JSON was not kept is marked on its page as
such (printed output, scratch, not committed) and as of code since changed."""
import json
import os
import re
import statistics
import subprocess
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, 'docs', 'results')
NUMBER = r'(-?\d+(?:\.\d+)?)'


def load(name: str):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def member(archive: str, name: str):
    """A JSON file inside one of the ``_logs.tar.gz`` archives beside the JSON."""
    with tarfile.open(os.path.join(RESULTS, archive)) as tar:
        return json.load(tar.extractfile(name))


def pick(entries, **fields):
    """The one entry of a list of comparisons whose fields equal ``fields``."""
    found = [e for e in entries if all(e.get(k) == v for k, v in fields.items())]
    assert len(found) == 1, (fields, len(found))
    return found[0]


def comparisons(data):
    return data if isinstance(data, list) else data['results']


def ratio(entry, candidate: str, baseline: str, mode: str = None):
    """Ratio of the medians of two timed steps of one comparison (``name/mode`` keys when ``mode`` is given)."""
    def med(name):
        return statistics.median(entry['times'][f'{name}/{mode}' if mode else name])
    return med(candidate) / med(baseline)


def both(entry, candidate, baseline):
    """(training step, inference) ratios."""
    return [ratio(entry, candidate, baseline, m) for m in ('training step', 'inference')]


def summed(rows, prefix, key='eager_ms'):
    """A CUDA-graph comparison's layer (``auto``) over conv times, the three shapes summed."""
    return sum(r[key] for r in rows if r['case'].startswith(prefix))


def graphs(rows, key):
    return summed(rows, 'auto', key) / summed(rows, 'conv3x3', key)


def cases(rows):
    return {r['case']: r for r in rows}


def _run5_layer():
    return load('gpu_h200_run5_check_layer.json')['results']


def layer(results, execution, dtype, batch, mode):
    return pick(results['layer_vs_conv'], execution=execution, dtype=dtype, batch=batch, mode=mode)['ratio_summed']


def _cpu_layer(name):
    rows = load(name)['results']
    return sum(r['auto']['ms'] for r in rows) / sum(r['conv3x3']['ms'] for r in rows)


def _device(dtype):
    """The layer's device time over the conv's, per shape (run 5's torch.profiler part of the tune tool)."""
    prof = _run5_layer()['tc_kernels']['profile']
    us = {(p['shape'], p['module']): p['device_us'] for p in prof if p['dtype'] == dtype}
    return [us[(s, 'lambda')] / us[(s, 'conv3x3')] for s in ('c4', 'c5_s2', 'c5')]


def _sweep(select, each=False):
    """Speed-ups over the default config of the configs that ``select(row, config)`` picks in run 5's sweep (their
    range, or with ``each`` every one)."""
    rows = member('gpu_h200_run5_check_layer_logs.tar.gz', 'layer_files/tune_tc_kernels.json')['rows']
    out = []
    for r in rows:
        if r['part'] == 'sweep':
            out += [r['default']['ms'] / c['ms'] for c in r['configs'] if select(r, c['config'])]
    return out if each else [min(out), max(out)]


def _plain(c):
    return 'num_stages' not in c and c['num_warps'] == 4


def run5_layer_table():
    r = _run5_layer()
    out = []
    for ex in ('triton_tc', 'gemm', 'triton_fma'):
        out += [layer(r, ex, d, b, 'train') for b in (1, 8) for d in ('float32', 'bfloat16')]
    return out


def _run5_sources():
    """Run 5's layer check, batch-1 backbone comparison, model comparisons, graphed cases and C4 comparison."""
    r5 = _run5_layer()
    b1 = pick(load('gpu_h200_run5_models_backbone_b1.json'), comparison='backbone', batch=1)
    cuda = load('gpu_h200_run5_models_cuda.json')
    g = cases(r5['models']['models_graphs'][0]['rows'])
    c4 = load('gpu_h200_run5_check_mission.json')['results']['models']['models_c4'][0]
    return r5, b1, cuda, g, c4


def readme_gpu():
    r5, b1, cuda, g, c4 = _run5_sources()
    b4 = [pick(cuda, comparison='backbone', batch=4, dtype=d) for d in ('torch.float32', 'torch.bfloat16')]
    return ([layer(r5, 'triton_tc', d, 8, 'train') for d in ('float32', 'bfloat16')]
            + [layer(r5, 'triton_tc', d, 8, 'eval') for d in ('float32', 'bfloat16')]
            + [layer(r5, 'triton_tc', 'float32', 1, 'train'), graphs(r5['cuda_graphs_batch1'], 'graphed_ms'),
               layer(r5, 'triton_tc', 'float32', 1, 'eval')]
            + [ratio(b1, 'LambdaResNet-101', 'ResNet-RS-101+SE', 'training step'),
               g['LambdaResNet-101 features 1024px']['graphed_ms']
               / g['ResNet-RS-101+SE features 1024px']['graphed_ms'],
               ratio(b1, 'LambdaResNet-101', 'ResNet-RS-101+SE', 'inference')]
            + [ratio(e, 'LambdaResNet-101', 'ResNet-RS-101+SE', 'training step') for e in b4]
            + [ratio(e, 'LambdaResNet-101', 'ResNet-RS-101+SE', 'inference') for e in b4]
            + [ratio(c4, 'LambdaResNet-101-C4', 'LambdaResNet-101-C4 conv twin', 'training step'),
               g['LambdaResNet-101-C4 features 512px']['graphed_ms']
               / g['LambdaResNet-101-C4 conv twin features 512px']['graphed_ms'],
               ratio(c4, 'LambdaResNet-101-C4', 'LambdaResNet-101-C4 conv twin', 'inference')])


def readme_cpu():
    bb, c4 = load('backbone_1024.json')[0], load('c4_512.json')[0]
    onnx = pick(load('onnx.json'), size=512)
    return ([_cpu_layer('lambda_layer.json'), _cpu_layer('lambda_layer_eval.json'),
             _cpu_layer('lambda_layer_bf16.json'), _cpu_layer('lambda_layer_eval_bf16.json'),
             ratio(bb, 'LambdaResNet-101', 'ResNet-RS-101+SE', 'training step'),
             bb['peak_mib']['LambdaResNet-101'] / bb['peak_mib']['ResNet-RS-101+SE'],
             ratio(bb, 'LambdaResNet-101', 'ResNet-RS-101+SE', 'inference')]
            + both(c4, 'LambdaResNet-101-C4', 'LambdaResNet-101-C4 conv twin')
            + both(load('c4_512_bf16.json')[0], 'LambdaResNet-101-C4', 'LambdaResNet-101-C4 conv twin')
            + both(load('classification_224.json')[0], 'LambdaResNet-101', 'ResNet-RS-101+SE')
            + [ratio(load(f)[0], 'LambdaResNet-101 compiled', 'ResNet-RS-101+SE compiled')
               for f in ('compile_512.json', 'compile_1024.json')]
            + [ratio(onnx, f'LambdaResNet-101 {e}', f'ResNet-RS-101+SE {e}') for e in ('legacy', 'dynamo')])


def _fma_shares():
    shares = [r['auto']['share_of_fma_peak'] * 100 for f in ('lambda_layer.json', 'lambda_layer_eval.json')
              for r in load(f)['results']]
    return [min(shares), max(shares)]


def run5_models():
    r5, b1, cuda, g, c4 = _run5_sources()
    lam, se, twin = 'LambdaResNet-101', 'ResNet-RS-101+SE', 'LambdaResNet-101-C4 features 512px'
    out = both(b1, lam, se) + [g[f'{lam} features 1024px']['graphed_ms'] / g[f'{se} features 1024px']['graphed_ms'],
                               g[f'{lam} features 1024px']['graphed_ms'], g[f'{se} features 1024px']['graphed_ms']]
    out += both(b1, lam, 'ResNet-RS-101 without SE')
    for d in ('torch.float32', 'torch.bfloat16'):
        out += both(pick(cuda, comparison='backbone', batch=4, dtype=d), lam, se)
    twin_g = g['LambdaResNet-101-C4 conv twin features 512px']['graphed_ms']
    out += both(c4, 'LambdaResNet-101-C4', 'LambdaResNet-101-C4 conv twin') + [
        g[twin]['graphed_ms'] / twin_g, g[twin]['graphed_ms'], twin_g]
    for d in ('torch.float32', 'torch.bfloat16'):
        out += both(pick(cuda, comparison='classification', dtype=d), 'LambdaResNet-50', "timm's lambda_resnet50ts")
    return out


def run4_models():
    """Run 4's model table: the backbone at batch 1 (the layer check's models part), CUDA graphs, batch 4 and the
    classifiers (measured beside the model tests), the C4 network (measured alone)."""
    b1 = load('gpu_h200_check_layer.json')['results']['models']['models_backbone_b1'][0]
    g = cases(load('gpu_h200_graphs.json')['results'])
    cuda = load('gpu_h200_models_cuda.json')['results']
    c4 = load('gpu_h200_models_c4.json')['results'][0]
    lam, se = 'LambdaResNet-101', 'ResNet-RS-101+SE'
    lg, sg = g[f'{lam} features 1024px']['graphed_ms'], g[f'{se} features 1024px']['graphed_ms']
    out = both(b1, lam, se) + [lg / sg, lg, sg] + both(b1, lam, 'ResNet-RS-101 without SE')
    for d in ('torch.float32', 'torch.bfloat16'):
        out += both(pick(cuda, comparison='backbone', batch=4, dtype=d), lam, se)
    cg, tg = (g[f'LambdaResNet-101-C4{t} features 512px']['graphed_ms'] for t in ('', ' conv twin'))
    out += both(c4, 'LambdaResNet-101-C4', 'LambdaResNet-101-C4 conv twin') + [cg / tg, cg, tg]
    for d in ('torch.float32', 'torch.bfloat16'):
        out += both(pick(cuda, comparison='classification', dtype=d), 'LambdaResNet-50', "timm's lambda_resnet50ts")
    return out


def run4_nose():
    b1 = load('gpu_h200_check_layer.json')['results']['models']['models_backbone_b1'][0]
    return both(b1, 'LambdaResNet-101', 'ResNet-RS-101 without SE')


def _peaks(results, execution):
    e = pick(results['layer_vs_conv'], execution=execution, dtype='float32', batch=8, mode='train')
    return [s['layer_peak_mib'] for s in e['shapes'].values()]


def run4_layer_table():
    r = load('gpu_h200_check_layer.json')['results']
    t = [layer(r, 'tensor_cores', d, b, m) for m in ('train', 'eval') for b in (1, 8) for d in ('float32', 'bfloat16')]
    return (t[:4] + [t[4], t[5], t[6], t[7]]
            + [layer(r, ex, d, b, 'train') for ex in ('gemm', 'cuda_cores') for b in (1, 8)
               for d in ('float32', 'bfloat16')])


def _spread(entry, key):
    t = entry['times'][key]
    return [statistics.median(t), min(t), max(t)]


def model_table(name, models, baseline):
    """A CPU model table's rows: training median [min-max], x the baseline, inference likewise, peak memory (and
    its ratio in the first row)."""
    e = load(name)[0]
    out = []
    for i, m in enumerate(models):
        for mode in ('training step', 'inference'):
            out += _spread(e, f'{m}/{mode}') + [ratio(e, m, baseline, mode)]
        out += [e['peak_mib'][m]] + ([e['peak_mib'][m] / e['peak_mib'][baseline]] if i == 0 else [])
    return out


def layer_table():
    """The CPU layer table: per shape, training conv and lambda (median [min-max], GMAC/s, share of the limit), x
    conv, eval likewise, peak MiB training (eval) conv / lambda; then the totals."""
    train, ev = load('lambda_layer.json')['results'], load('lambda_layer_eval.json')['results']
    out = []

    def cell(x):
        return [x['ms'], x['min_ms'], x['max_ms'], x['gmac_per_s'], 100 * x['share_of_fma_peak']]
    for t, e in zip(train, ev):
        out += cell(t['conv3x3']) + cell(t['auto']) + [t['auto']['ms'] / t['conv3x3']['ms']]
        out += cell(e['conv3x3']) + cell(e['auto']) + [e['auto']['ms'] / e['conv3x3']['ms']]
        out += [t['conv3x3']['peak_mib'], e['conv3x3']['peak_mib'], t['auto']['peak_mib'], e['auto']['peak_mib']]
    for rows in (train, ev):
        out += [sum(r['conv3x3']['ms'] for r in rows), sum(r['auto']['ms'] for r in rows),
                _cpu_layer('lambda_layer.json' if rows is train else 'lambda_layer_eval.json')]
    return out


def host_time(commit):
    """The load before and the ``autograd.Function`` step of each row; the file must be of the commit the page
    names."""
    d = load('host_time.json')
    assert d['commit'].startswith(commit) and d['commit'].endswith('+dirty'), d['commit']
    return [d['load_before'][0]] + [r['us_per_step']['autograd.Function'] for r in d['rows']]


def runs_1_to_3_models():
    """Runs 1-3's model table: per row (backbone float32, bfloat16; classifier float32, bfloat16) the three runs."""
    runs = [load(f'gpu_h200_models_{n}.json')['results'] for n in ('before', 'fold', 'triton')]
    out = []
    for comparison, a, b in (('backbone', 'LambdaResNet-101', 'ResNet-RS-101+SE'),
                             ('classification', 'LambdaResNet-50', "timm's lambda_resnet50ts")):
        for d in ('torch.float32', 'torch.bfloat16'):
            for run in runs:
                out += both(pick(run, comparison=comparison, dtype=d), a, b)
    return out


# (page, passage with {} for each figure, the figures from the JSON)

def one_operator_counts():
    """The one-operator section's count table and LambdaResNet-101 shapes' triton_tc kernels in all."""
    rows = {(r['shape'], r['mode']): r for r in load('launches_one_operator.json')['rows']}
    out = []
    for mode in ('train f32', 'eval f32', 'eval f32 reparameterized'):
        s1, s2 = rows[('16ch 4x4', mode)], rows[('16ch 4x4 stride 2', mode)]
        out += [s1['backends']['cpu_kernel']['operators'], s2['backends']['cpu_kernel']['operators'],
                s1['backends']['cpu_kernel']['aten'], s2['backends']['cpu_kernel']['aten'],
                s1['backends']['triton_tc']['aten'], s1['backends']['triton_tc']['triton'],
                s2['backends']['triton_tc']['aten'], s2['backends']['triton_tc']['triton']]
    for shape in ('c4 256ch', 'c5 512ch stride 2', 'c5 512ch'):
        t = rows[(shape, 'train f32')]['backends']['triton_tc']
        out += [t['aten'], t['triton']]
    return out


def one_operator_times():
    """The one-operator section's host-time table: load, then per row conv, 269e94e's layer, this layer, ratio."""
    now, before = load('host_time_one_operator.json'), load('host_time_before_one_operator.json')
    assert before['commit'].startswith('269e94e')
    out = [now['load_before'][0]]
    for a, b in zip(now['rows'], before['rows']):
        assert (a['stride'], a['mode']) == (b['stride'], b['mode'])
        out += [a['us']['conv'], b['us']['lambda'], a['us']['lambda'], a['ratio']]  # (of the unrounded medians)
    return out + [r['ratio_reparameterized'] for r in now['rows'] if r['mode'] == 'eval']


def detection_shapes():
    """The one operator's speed at the detection shapes: layer / conv summed, before and after, then per shape."""
    def ratios(name):
        r = load(name)['results']
        return (sum(x['auto']['ms'] for x in r) / sum(x['conv3x3']['ms'] for x in r),
                [x['auto']['ms'] / x['conv3x3']['ms'] for x in r])
    (b, bs), (a, as_) = ratios('detection_shapes_269e94e.json'), ratios('detection_shapes_one_operator.json')
    assert load('detection_shapes_269e94e.json')['commit'].startswith('269e94e')
    return [b, a] + [x for pair in zip(bs, as_) for x in pair]


def lean_detection_shapes():
    """The leaner host path at the detection shapes: layer / conv summed, 6ce8794, then this (two runs)."""
    def summed(name):
        r = load(name)['results']
        return sum(x['auto']['ms'] for x in r) / sum(x['conv3x3']['ms'] for x in r)
    assert load('detection_shapes_before_lean.json')['commit'].startswith('6ce8794')
    return [summed(n) for n in ('detection_shapes_before_lean.json', 'detection_shapes_lean_1.json',
                                'detection_shapes_lean_2.json')]


def lean_counts():
    """The "less host work" passage's kernel counts: cpu_kernel training, eval, eval reparameterized at stride 1 / 2,
    then triton_tc's training at stride 1 (aten, Triton)."""
    rows = {(r['shape'], r['mode']): r['backends'] for r in load('launches_lean.json')['rows']}
    out = [rows[(shape, mode)]['cpu_kernel']['aten'] for mode in ('train f32', 'eval f32', 'eval f32 reparameterized')
           for shape in ('16ch 4x4', '16ch 4x4 stride 2')]
    t = rows[('16ch 4x4', 'train f32')]['triton_tc']
    return out + [t['aten'], t['triton']]


def lean_times():
    """Its host-time table: the loads before (lowest, highest), then per row before 1 / 2, now 1 / 2 (layer / conv)."""
    now = [load(f'host_time_lean_{i}.json') for i in (1, 2)]
    before = [load(f'host_time_before_lean_{i}.json') for i in (1, 2)]
    assert all(d['commit'].startswith('6ce8794') for d in before)
    assert all(d['commit'].startswith('eb9f77f') for d in now)
    loads = [d['load_before'][0] for d in now + before]
    out = [min(loads), max(loads)]
    for stride in (1, 2):
        for mode, key in (('train', 'ratio'), ('eval', 'ratio'), ('eval', 'ratio_reparameterized')):
            for d in before + now:
                row, = [r for r in d['rows'] if (r['stride'], r['mode']) == (stride, mode)]
                out.append(row[key])
    return out


FIGURES = [
    ('docs/benchmarks.md', """| training, float32 | 4 | {} / {} | {} / {} | {} + {} / {} + {} |
| eval | 1 | {} / {} | {} / {} | {} + {} / {} + {} |
| eval, reparameterized | 1 | {} / {} | {} / {} | {} + {} / {} + {} |

(269e94e's operators: the issue's count, 17 / 44 and 6 / 18.) At LambdaResNet-101's shapes the operators are the
same 11 and 4; `triton_tc`'s kernels in all: c4 {} + {}, c5 stride 2 {} + {}, c5 {} + {}""", one_operator_counts),
    ('docs/benchmarks.md', """load {} (others' jobs: CPU time, not wall time), medians in us; """
     """269e94e's layer timed by the same tool in a process
right after (`results/host_time_before_one_operator.json`), this one in `results/host_time_one_operator.json`:

| step | conv | layer 269e94e | layer now | now / conv |
|---|---:|---:|---:|---:|
| training, stride 1 | {} | {} | {} | {} |
| eval, stride 1 | {} | {} | {} | {} |
| training, stride 2 | {} | {} | {} | {} |
| eval, stride 2 | {} | {} | {} | {} |

After `reparameterize()` the eval forward is {}x the conv at stride 1 and {}x at stride 2.""", one_operator_times),
    ('docs/benchmarks.md', """`cpu_kernel` training {} / {} at stride 1 / 2,
eval {} / {}, eval reparameterized {} / {} (were 29 / 31, 7 / 8, 5 / 6); `triton_tc` unchanged ({} + {} training at
stride 1)""", lean_counts),
    ('docs/benchmarks.md', """load 0.7-1.0): layer / conv summed {}x at 6ce8794
and {}x / {}x now""", lean_detection_shapes),
    ('docs/benchmarks.md', """load {} to {} before each,
layer / conv (`results/host_time_lean_{1,2}.json`, `results/host_time_before_lean_{1,2}.json`):

| step | before (6ce8794), pair 1 / 2 | now (eb9f77f), pair 1 / 2 |
|---|---:|---:|
| training, stride 1 | {} / {} | {} / {} |
| eval, stride 1 | {} / {} | {} / {} |
| eval reparameterized, stride 1 | {} / {} | {} / {} |
| training, stride 2 | {} / {} | {} / {} |
| eval, stride 2 | {} / {} | {} / {} |
| eval reparameterized, stride 2 | {} / {} | {} / {} |""", lean_times),
    ('docs/benchmarks.md', """layer / conv summed
{}x before and {}x after (c4 {}x / {}x, c5 stride 2 {}x / {}x, c5 {}x / {}x)""", detection_shapes),
    ('README.md', """| one lambda layer / its 3x3 conv, 1024 px shapes summed, batch 8, TF32 / bf16 autocast |
{} / {} | {} / {} |
| the same, batch 1; replayed from CUDA graphs (TF32) | {}; graphed {} | {} |
| LambdaResNet-101 / ResNet-RS-101+SE, backbone, 1024 px, batch 1, float32; graphed | {}; {} | {} |
| the same, batch 4, float32 / bf16 autocast | {} / {} | {} / {} |
| LambdaResNet-101-C4 / its conv twin, 512 px, batch 1, float32; graphed | {}; {} | {} |""", readme_gpu),
    ('README.md', 'its device time was {}-{}x the conv\'s in TF32, {}-{}x in bf16',
     lambda: [min(_device('float32')), max(_device('float32')), min(_device('bfloat16')), max(_device('bfloat16'))]),
    ('README.md', """| one lambda layer / its 3x3 conv, LambdaResNet-101's c4 and c5 shapes at 1024 px, batch 1 |
{} | {} |
| the same under bfloat16 autocast (AVX-512 BF16), 1024 px | {} | {} |
| LambdaResNet-101 / ResNet-RS-101+SE, backbone c2..c5, 1024 px, batch 1 | {} ({} peak memory) | {} |
| LambdaResNet-101-C4 / its conv twin (every lambda layer a 3x3 conv), 512 px, batch 1 | {} | {} |
| the same under bfloat16 autocast | {} | {} |
| LambdaResNet-101 / ResNet-RS-101+SE, classifier, 224 px, batch 2 | {} | {} |
| the same, `torch.compile` (training step), 512 / 1024 px | {} / {} | - |
| the same, ONNX Runtime (inference), 512 px, legacy / dynamo exporter | - | {} / {} |""", readme_cpu),
    ('README.md', 'The layer ran at {}-{}% of the CPU\'s float32 limit', _fma_shares),
    ('docs/benchmarks.md', """| tensor_cores | {} (4.96) | {} (4.86) | {} (4.58) | {} (4.73) | {} / {} | {} / {} |
| gemm | {} | {} | {} | {} | - | - |
| cuda_cores | {} | {} | {} | {} | - | - |""",
     lambda: (lambda r, t: t[:4] + [layer(r, 'triton_tc', d, b, 'eval') for b in (1, 8)
                                    for d in ('float32', 'bfloat16')] + t[4:])(_run5_layer(), run5_layer_table())),
    ('docs/benchmarks.md', """Replayed from CUDA graphs (batch 1, training step, TF32): the layers {} / {} / {} ms,
the convs {} / {} / {} ms: **{}x summed** (run 4: {}x; eager {}x).""",
     lambda: (lambda rows, r4: [r['graphed_ms'] for r in rows if r['case'].startswith('auto')]
              + [r['graphed_ms'] for r in rows if r['case'].startswith('conv3x3')]
              + [graphs(rows, 'graphed_ms'), graphs(r4, 'graphed_ms'), graphs(rows, 'eager_ms')])(
         _run5_layer()['cuda_graphs_batch1'], load('gpu_h200_graphs.json')['results'])),
    ('docs/benchmarks.md', """layer's kernels take {} / {} / {} ms in TF32 against the conv's {} / {} / {}
({}x / {}x / {}x), and
{} / {} / {} ms in bf16 against {} / {} / {};""",
     lambda: (lambda p: [p[(s, 'lambda', 'float32')] for s in ('c4', 'c5_s2', 'c5')]
              + [p[(s, 'conv3x3', 'float32')] for s in ('c4', 'c5_s2', 'c5')] + _device('float32')
              + [p[(s, m, 'bfloat16')] for m in ('lambda', 'conv3x3') for s in ('c4', 'c5_s2', 'c5')])(
         {(x['shape'], x['module'], x['dtype']): x['device_us'] / 1000
          for x in _run5_layer()['tc_kernels']['profile']})),
    ('docs/benchmarks.md', """| LambdaResNet-101 | 34.82 | {} [{}-{}] | **{}** | {} [{}-{}] | **{}** | {} (**{}x**) |
| ResNet-RS-101 + SE | 61.57 | {} [{}-{}] | {} | {} [{}-{}] | {} | {} |
| ResNet-RS-101 without SE | 42.56 | {} [{}-{}] | {} | {} [{}-{}] | {} | {} |
| LambdaResNet-101's conv twin (every lambda layer a 3x3 conv) | 43.18 | {} [{}-{}] | {} | {} [{}-{}] | {} | {} |
| LambdaResNet-101, lambda layers skipped | 34.34 | {} [{}-{}] | {} | {} [{}-{}] | {} | {} |""",
     lambda: model_table('backbone_1024.json', [
         'LambdaResNet-101', 'ResNet-RS-101+SE', 'ResNet-RS-101 without SE', 'LambdaResNet-101 conv twin',
         'LambdaResNet-101, lambda layers skipped'], 'ResNet-RS-101+SE')),
    ('docs/benchmarks.md', """| LambdaResNet-101-C4 | 23.93 | {} [{}-{}] | **{}** | {} [{}-{}] | **{}** | {} ({}x) |
| its conv twin | 43.18 | {} [{}-{}] | {} | {} [{}-{}] | {} | {} |
| LambdaResNet-101-C4, lambda layers skipped | 22.54 | {} [{}-{}] | {} | {} [{}-{}] | {} | {} |""",
     lambda: model_table('c4_512.json', [
         'LambdaResNet-101-C4', 'LambdaResNet-101-C4 conv twin', 'LambdaResNet-101-C4, lambda layers skipped'],
         'LambdaResNet-101-C4 conv twin')),
    ('docs/benchmarks.md', """| 256, 64x64, stride 1 (c4) | {} [{}-{}], {} ({}%) | {} [{}-{}], {} ({}%) | {}x |
{} [{}-{}], {} ({}%) | {} [{}-{}], {} ({}%) | {}x | {} ({}) / {} ({}) |
| 512, 64x64, stride 2 (first c5 block) | {} [{}-{}], {} ({}%) | {} [{}-{}], {} ({}%) | {}x |
{} [{}-{}], {} ({}%) | {} [{}-{}], {} ({}%) | {}x | {} ({}) / {} ({}) |
| 512, 32x32, stride 1 (c5) | {} [{}-{}], {} ({}%) | {} [{}-{}], {} ({}%) | {}x |
{} [{}-{}], {} ({}%) | {} [{}-{}], {} ({}%) | {}x | {} ({}) / {} ({}) |
| **total** | {} | {} | **{}x** | {} | {} | **{}x** | |""", layer_table),
    ('docs/benchmarks.md', '`results/host_time.json` (at 1d29a77+dirty, load {}): {} / {} / {} us for the three rows',
     lambda: host_time('1d29a77')),
    ('docs/benchmarks.md', '16-bit rows at 16 query rows\n{}-{}x faster than at 32 (c4, c5; {}x at 64 rows)',
     lambda: _sweep(lambda r, c: r['kernel'].startswith('tc_rows') and r['dtype'] == 'bfloat16'
                    and r['shape'] in ('c4', 'c5') and c['BLOCK_Q'] * c['BLOCK_H'] == 16 and _plain(c))
     + [max(_sweep(lambda r, c: r['kernel'].startswith('tc_rows') and r['dtype'] == 'bfloat16'
                   and c['BLOCK_Q'] * c['BLOCK_H'] == 64))]),
    ('docs/benchmarks.md', 'gradient at 128 channels a program {}-{}x at |v| = 128',
     lambda: _sweep(lambda r, c: r['kernel'] == 'tc_value_grad' and r['default']['config']['BLOCK_V'] == 64
                    and c['BLOCK_V'] == 128 and _plain(c))),
    ('docs/benchmarks.md', """| LambdaResNet-101 / RS-101+SE, backbone, 1024 px, batch 1 | {}x / {}x |
{}x ({} / {} ms) |
| LambdaResNet-101 / RS-101 without SE, same | {}x / {}x | - |
| LambdaResNet-101 / RS-101+SE, 1024 px, batch 4, float32 / bf16 autocast | {}x / {}x, {}x / {}x | - |
| LambdaResNet-101-C4 / its conv twin, 512 px, batch 1 | {}x / {}x | {}x ({} / {} ms) |
| LambdaResNet-50 / timm's `lambda_resnet50ts`, 224 px, batch 64, float32 / bf16 | {}x / {}x, {}x / {}x | - |""",
     run5_models),
    ('docs/benchmarks.md', 'lambda layers skipped is already {}x / {}x RS-101',
     lambda: both(pick(load('gpu_h200_run5_models_backbone_b1.json'), comparison='backbone', batch=1),
                  'LambdaResNet-101, lambda layers skipped', 'ResNet-RS-101 without SE')),
    ('docs/benchmarks.md', """| LambdaResNet-101 / RS-101+SE, backbone, 1024 px, batch 1 | {}x / {}x |
{}x ({} / {} ms) |
| LambdaResNet-101 / RS-101 without SE, same | {}x / {}x | - |
| LambdaResNet-101 / RS-101+SE, 1024 px, batch 4, float32 / bf16 autocast (*) | {}x / {}x, {}x / {}x | - |
| LambdaResNet-101-C4 / its conv twin, 512 px, batch 1 | {}x / {}x | {}x ({} / {} ms) |
| LambdaResNet-50 / timm's `lambda_resnet50ts`, 224 px, batch 64, float32 / bf16 (*) | {}x / {}x, {}x / {}x |""",
     run4_models),
    ('docs/benchmarks.md', '(targets 1.0x) and {}x / {}x RS-101 without SE', run4_nose),
    ('docs/benchmarks.md', """| tensor_cores | **{}** | **{}** | **{}** | **{}** | {} / {} | {} / {} |
| gemm | {} | {} | {} | {} | - | - |
| cuda_cores | {} | {} | {} | {} | - | - |""", run4_layer_table),
    ('docs/benchmarks.md', 'Peak training-step memory of the three layers at batch 8, float32: {} MiB (tensor cores) '
                           'against {} (GEMM path).',
     lambda: (lambda r: [sum(_peaks(r, 'tensor_cores')), sum(_peaks(r, 'gemm'))])(
         load('gpu_h200_check_layer.json')['results'])),
    ('docs/benchmarks.md', 'Peak memory at batch 8, float32: {} / {} / {} MiB (GEMM path {} / {} / {})',
     lambda: (lambda r: _peaks(r, 'triton_tc') + _peaks(r, 'gemm'))(_run5_layer())),
    ('docs/benchmarks.md', """the same layers take {} / {} / {} ms against eager {} / {} / {} ms, and the convs
{} / {} / {} ms against {} / {} / {}: graphed, the layer is {}x the conv summed (eager, in this comparison: {}x)""",
     lambda: (lambda rows: [r[k] for k in ('graphed_ms', 'eager_ms') for r in rows if r['case'].startswith('auto')]
              + [r[k] for k in ('graphed_ms', 'eager_ms') for r in rows if r['case'].startswith('conv3x3')]
              + [graphs(rows, 'graphed_ms'), graphs(rows, 'eager_ms')])(load('gpu_h200_graphs.json')['results'])),
    ('docs/benchmarks.md', '(the c4 layer in run 4: {} ms eager, {} ms from a CUDA graph; run 5:\n{} / {})',
     lambda: [cases(load('gpu_h200_graphs.json')['results'])['auto 256ch 64px s1'][k]
              for k in ('eager_ms', 'graphed_ms')]
     + [cases(_run5_layer()['cuda_graphs_batch1'])['auto 256ch 64px s1'][k] for k in ('eager_ms', 'graphed_ms')]),
    ('README.md', "its AVX2 + FMA build took {}x the conv in training (float32; bfloat16 {}x; 2026-11-29, "
                  "b7bdade+dirty's",
     lambda: _isa_dated('2026-11-29', 'b7bdade')
     + [_isa_summed('cpu_isa.json', f'train {d}', 'cpu_kernel[x86-64-v3]') for d in ('float32', 'bfloat16')]),
    ('docs/benchmarks.md', "On AVX2 the kernel's training step is {}x / {}x / {}x the conv ({}x summed) in float32",
     lambda: _isa_rows('cpu_isa.json', 'train', 'float32', 'cpu_kernel[x86-64-v3]')
     + [_isa_summed('cpu_isa.json', 'train float32', 'cpu_kernel[x86-64-v3]')]),
    ('docs/benchmarks.md', """float32: the AVX2 kernel's training step {}x / {}x / {}x the conv
(CPU time {}x / {}x / {}x), {}x summed (AVX-512 build {}x, gemm backend {}x); eval {}x summed ({}x, {}x)""",
     lambda: _isa_rows('cpu_isa_avx2_libraries.json', 'train', 'float32', 'cpu_kernel[x86-64-v3]')
     + _isa_rows('cpu_isa_avx2_libraries.json', 'train', 'float32', 'cpu_kernel[x86-64-v3]', 'cpu_ratio')
     + [_isa_summed('cpu_isa_avx2_libraries.json', f'{m} float32', k) for m in ('train', 'eval')
        for k in ('cpu_kernel[x86-64-v3]', 'cpu_kernel[native]', 'gemm')]),
    ('docs/benchmarks.md', 'docs/results/cpu_isa_avx2_libraries_s2.json`, load {}): the AVX2 kernel {}x the conv, the '
     'AVX-512 build {}x, the\ngemm backend {}x',
     lambda: [float(load('cpu_isa_avx2_libraries_s2.json')['load_before'].split()[0])]
     + [load('cpu_isa_avx2_libraries_s2.json')['results'][0][k]['ratio']
        for k in ('cpu_kernel[x86-64-v3]', 'cpu_kernel[native]', 'gemm')]),
    ('docs/benchmarks.md', """| LambdaResNet-101 vs RS-101+SE, 1024 px, batch 4, float32 | {}x / {}x | **{}x / {}x** |
{}x / {}x |
| same, bfloat16 | {}x / {}x | **{}x / {}x** | {}x / {}x |
| LambdaResNet-50 vs timm's `lambda_resnet50ts`, 224 px, batch 64, float32 | {}x / {}x | {}x / {}x |
**{}x / {}x** |
| same, bfloat16 | {}x / {}x | {}x / {}x | **{}x / {}x** |""", runs_1_to_3_models),
]


# Sections added after the first registry: CPU bfloat16, torch.compile, ONNX Runtime, classifiers.

def at_commit(commit: str, name: str):
    """A result JSON as committed at ``commit`` (git history); the test is skipped where the history is absent (a
    shallow clone, an unpacked archive)."""
    try:
        out = subprocess.run(['git', 'show', f'{commit}:docs/results/{name}'], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f'docs/results/{name} at {commit}: no git history here')
    return json.loads(out)


def _summed(rows):
    return sum(r['auto']['ms'] for r in rows) / sum(r['conv3x3']['ms'] for r in rows)


BF16_LAYER = ('lambda_layer_bf16.json', 'lambda_layer_eval_bf16.json', 'lambda_layer_512_bf16.json')
# The run an hour before (b5d9f00): the files as committed before d52904a replaced them.
BF16_BEFORE = 'd52904a^'


def bf16_layer_table():
    """Per shape and column (1024 px training, eval, 512 px training): the layer's ms, x the conv, the earlier run's
    ratio, G/s; then the totals, each with the earlier run's."""
    now = [load(f)['results'] for f in BF16_LAYER]
    before = [at_commit(BF16_BEFORE, f)['results'] for f in BF16_LAYER]
    out = []
    for i in range(3):
        for rows, old in zip(now, before):
            r, o = rows[i], old[i]
            out += [r['auto']['ms'], r['auto']['ms'] / r['conv3x3']['ms'], o['auto']['ms'] / o['conv3x3']['ms'],
                    r['auto']['gmac_per_s']]
    for rows, old in zip(now, before):
        out += [_summed(rows), _summed(old)]
    return out


def bf16_conv_moves():
    """The stride-2 bfloat16 conv's median, the earlier run's and this one's, at 1024 and 512 px."""
    out = []
    for f in ('lambda_layer_bf16.json', 'lambda_layer_512_bf16.json'):
        out += [at_commit(BF16_BEFORE, f)['results'][1]['conv3x3']['ms'], load(f)['results'][1]['conv3x3']['ms']]
    return out


def _med(entry, key):
    return statistics.median(entry['times'][key])


def _loads(entry):
    return [float(entry['load_before'].split()[0]), float(entry['load_after'].split()[0])]


def c4_bf16():
    e = load('c4_512_bf16.json')[0]
    old = at_commit(BF16_BEFORE, 'c4_512_bf16.json')[0]
    c4 = 'LambdaResNet-101-C4'
    twin, skip = f'{c4} conv twin', f'{c4}, lambda layers skipped'
    return (_loads(e) + [ratio(e, c4, twin, 'training step'), _med(e, f'{c4}/training step'),
                         _med(e, f'{twin}/training step'), ratio(e, c4, twin, 'inference'),
                         _med(e, f'{c4}/inference'), _med(e, f'{twin}/inference')]
            + both(old, c4, twin) + [e['peak_mib'][c4], e['peak_mib'][twin]] + both(e, skip, twin))


def backbone_bf16():
    e = load('backbone_1024_bf16.json')[0]
    lam = 'LambdaResNet-101'
    return (_loads(e) + both(e, lam, 'ResNet-RS-101+SE') + both(e, lam, 'LambdaResNet-101 conv twin')
            + both(e, 'LambdaResNet-101, lambda layers skipped', 'ResNet-RS-101+SE'))


def compile_table(name):
    """Load before and after; per row min / median / max and x the compiled baseline; how much faster compiled is
    than eager (%); the first compiled steps and their ratio."""
    e = load(name)[0]
    lc, sc, le = 'LambdaResNet-101 compiled', 'ResNet-RS-101+SE compiled', 'LambdaResNet-101 eager'
    out = _loads(e)
    for k in (lc, sc, le):
        t = e['times'][k]
        out += [min(t), statistics.median(t), max(t)] + ([] if k == sc else [ratio(e, k, sc)])
    first = e['first_step_s']
    return out + [100 * (1 - ratio(e, lc, le)), first['LambdaResNet-101'], first['ResNet-RS-101+SE'],
                  first['LambdaResNet-101'] / first['ResNet-RS-101+SE']]


def onnx_table():
    """Per size and exporter: LambdaResNet-101 min / median / max, RS-101+SE's, the ratio, the lambda side's error."""
    out = []
    for e in load('onnx.json'):
        for x in ('legacy', 'dynamo'):
            lam, se = e['times'][f'LambdaResNet-101 {x}'], e['times'][f'ResNet-RS-101+SE {x}']
            out += [min(lam), statistics.median(lam), max(lam), min(se), statistics.median(se), max(se),
                    statistics.median(lam) / statistics.median(se), e['max_rel_error'][f'LambdaResNet-101 {x}'] * 1e7]
    return out


def classifiers():
    c, f = load('classification_224.json')[0], load('cifar.json')[0]
    lam, se, g, r50 = 'LambdaResNet-101', 'ResNet-RS-101+SE', 'resnet50_lambda global', 'ResNet-50'
    out = _loads(c)
    for mode in ('training step', 'inference'):
        out += [_med(c, f'{lam}/{mode}'), _med(c, f'{se}/{mode}'), ratio(c, lam, se, mode)]
    out += [c['peak_mib'][lam], c['peak_mib'][se], c['peak_mib'][lam] / c['peak_mib'][se]] + _loads(f)
    for mode in ('training step', 'inference'):
        out += [_med(f, f'{g}/{mode}'), _med(f, f'{r50}/{mode}'), ratio(f, g, r50, mode)]
    return out

FIGURES += [
    ('docs/benchmarks.md', """at
a6360ae (the JSON files; load {}-{} before), and in brackets the ratios of the run at b5d9f00 an hour earlier
(load {}-{}; the same kernels but for the pair GEMMs' row count):

| shape | 1024 px training | 1024 px eval | 512 px training |
|---|---|---|---|
| c4, stride 1 | {} ({}x) [{}x], {} G/s | {} ({}x) [{}x], {} G/s | {} ({}x) [{}x], {} G/s |
| first c5 block, stride 2 | {} ({}x) [{}x], {} G/s | {} ({}x) [{}x], {} G/s | {} ({}x) [{}x], {} G/s |
| c5, stride 1 | {} ({}x) [{}x], {} G/s | {} ({}x) [{}x], {} G/s | {} ({}x) [{}x], {} G/s |
| **total, x the bfloat16 conv** | **{}x** [{}x] | **{}x** [{}x] | **{}x** [{}x] |""",
     lambda: (lambda now, old: [min(now), max(now), min(old), max(old)])(
         [float(load(f)['load_before'].split()[0]) for f in BF16_LAYER],
         [float(at_commit(BF16_BEFORE, f)['load_before'].split()[0]) for f in BF16_LAYER]) + bf16_layer_table()),
    ('docs/benchmarks.md', '(the stride-2 one {} -> {} ms at\n1024 px, {} -> {} ms at 512 px)', bf16_conv_moves),
    ('docs/benchmarks.md', """at 1024 px
  {} MiB (c4, was 24), {} MiB (stride 2, the conv {}), {} MiB (c5, was 14)""",
     lambda: (lambda r: [r[0]['auto']['peak_mib'], r[1]['auto']['peak_mib'], r[1]['conv3x3']['peak_mib'],
                         r[2]['auto']['peak_mib']])(load('lambda_layer_bf16.json')['results'])),
    ('docs/benchmarks.md', """docs/results/c4_512_bf16.json` at a6360ae, load {} before, {} after):
  training **{}x** ({} vs {} s), inference **{}x** ({} vs {} s); at b5d9f00 (`--repeats 7`) {}x /
  {}x, peak memory {} vs {} MiB. The network with its lambda layers skipped is at {}x / {}x""", c4_bf16),
    ('docs/benchmarks.md', """docs/results/backbone_1024_bf16.json` at 18c20c1, load {} before, {} after):
  {}x / {}x ResNet-RS-101+SE (training / inference), {}x / {}x its conv twin; with its six lambda layers
  skipped {}x / {}x.""", backbone_bf16),
    ('docs/benchmarks.md', """AMD
EPYC family 25 model 17, load {} before, {} after:

| model | training step, min / median / max (s) | x compiled RS-101+SE |
|---|---|---|
| LambdaResNet-101, compiled | {} / {} / {} | **{}x** |
| ResNet-RS-101 + SE, compiled | {} / {} / {} | 1.00 |
| LambdaResNet-101, eager | {} / {} / {} | {}x |

Compiled LambdaResNet-101 is {}% faster than eager LambdaResNet-101 (each custom operator is one opaque node of the
compiled graph, its CPU kernel inside, and inductor compiles the glue around it). Its first compiled step
(compilation included) took {} s against {} s for ResNet-RS-101 + SE: **{}x**.""",
     lambda: compile_table('compile_512.json')),
    ('docs/benchmarks.md', """AMD EPYC family 25 model 17, load {} before, {} after;
same models, training step, batch 1, 5 rounds):

| model | training step, min / median / max (s) | x compiled RS-101+SE |
|---|---|---|
| LambdaResNet-101, compiled | {} / {} / {} | **{}x** |
| ResNet-RS-101 + SE, compiled | {} / {} / {} | 1.00 |
| LambdaResNet-101, eager | {} / {} / {} | {}x |

Compiled LambdaResNet-101 is {}% faster than eager in this run""",
     lambda: compile_table('compile_1024.json')[:-3]),
    ('docs/benchmarks.md', """(eager here is slower than in the backbone run
above, {} s: the spread between runs); its first compiled step took {} s against {} s (**{}x**).""",
     lambda: [_med(load('backbone_1024.json')[0], 'LambdaResNet-101/training step')]
     + compile_table('compile_1024.json')[-3:]),
    ('docs/benchmarks.md', """AMD EPYC family 25 model 17; load
{} before, {} after""",
     lambda: [_loads(load('onnx.json')[0])[0], _loads(load('onnx.json')[-1])[1]]),
    ('docs/benchmarks.md', """| 224 px | legacy | {} / {} / {} | {} / {} / {} | {}x | {}e-7 |
| 224 px | dynamo | {} / {} / {} | {} / {} / {} | {}x | {}e-7 |
| 512 px | legacy | {} / {} / {} | {} / {} / {} | **{}x** | {}e-7 |
| 512 px | dynamo | {} / {} / {} | {} / {} / {} | **{}x** | {}e-7 |""", onnx_table),
    ('docs/benchmarks.md', """(2026-11-23, load {} before, {} after): LambdaResNet-101 vs ResNet-RS-101 + SE,
batch 2: training step {} vs {} s median (**{}x**), inference {} vs {} s (**{}x**), peak training-step
memory {} vs {} MiB ({}x;
re-measured 2026-11-24 with the allocator method, `python tools/benchmark_models.py classification --memory-only
--json docs/results/classification_224.json`; the old counter gave 333 vs 409).

`python tools/benchmark_models.py cifar --repeats 7 --json docs/results/cifar.json` (2026-11-23, load {} before,
{} after): `resnet50_lambda` with a global scope at 32x32 vs timm's `resnet50`, 10 classes, batch 64: training
step {} vs {} s (**{}x**), inference {} vs {} s ({}x).""", classifiers),
]



# The launch-count table's columns: (file, commit of the file's version or None for the file as it is, the commit
# its JSON records).
LAUNCH_COLUMNS = [('launches_fbeda22.json', None, 'fbeda22'), ('launches.json', '9597bcd', '21a31bb'),
                  ('launches.json', '7390277', '7202888'), ('launches.json', '055a928', '1496807'),
                  ('launches.json', None, '7e0a69a+dirty')]


def launch_table():
    """Per row: the conv's count, ``triton_tc``'s aten + Triton counts in each column, ``gemm``'s at fbeda22,
    21a31bb and now (1d29a77); each JSON must name the column's commit."""
    runs = []
    for name, version, commit in LAUNCH_COLUMNS:
        d = load(name) if version is None else at_commit(version, name)
        assert d['commit'] == commit, (name, version, d['commit'])
        runs.append({(r['shape'], r['mode']): r for r in d['rows']})
    out = []
    for key in (('c4 256ch', 'train f32'), ('c4 256ch', 'eval f32'), ('c5 512ch stride 2', 'train f32'),
                ('c5 512ch stride 2', 'eval f32'), ('c5 512ch', 'train f32')):
        out.append(runs[-1][key]['conv'])
        for run in runs:
            tc = run[key]['backends']['triton_tc']
            out += [tc['aten'], tc['triton']]
        out += [runs[i][key]['backends']['gemm']['aten'] for i in (0, 1, 4)]
    return out


def autocast_casts():
    """The casts (``_to_copy``) a 16-bit training step adds for ``triton_tc`` and ``gemm`` at each shape (the gemm
    backend's step also has an mm or two more), and the conv's added kernels."""
    rows = {(r['shape'], r['mode']): r for r in load('launches.json')['rows']}
    added = set()
    for shape in ('c4 256ch', 'c5 512ch stride 2', 'c5 512ch'):
        lo, hi = rows[(shape, 'train f32')], rows[(shape, 'train 16-bit')]
        added |= {hi['backends'][b]['ops'].get('_to_copy', 0) - lo['backends'][b]['ops'].get('_to_copy', 0)
                  for b in ('triton_tc', 'gemm')}
    assert len(added) == 1, added
    return [added.pop(), rows[('c4 256ch', 'train 16-bit')]['conv'] - rows[('c4 256ch', 'train f32')]['conv']]

FIGURES += [
    ('docs/benchmarks.md', """| c4, 256 ch | training, float32 | {} |
{} + {} | {} + {} | {} + {} | {} + {} | {} + {} | {} | {} | {} |
| c4, 256 ch | eval | {} | {} + {} | {} + {} | {} + {} | {} + {} | {} + {} | {} | {} | {} |
| c5, 512 ch, stride 2 | training, float32 | {} | {} + {} | {} + {} | {} + {} | {} + {} | {} + {} | {} | {} | {} |
| c5, 512 ch, stride 2 | eval | {} | {} + {} | {} + {} | {} + {} | {} + {} | {} + {} | {} | {} | {} |
| c5, 512 ch | training, float32 | {} | {} + {} | {} + {} | {} + {} | {} + {} | {} + {} | {} | {} | {} |""",
     launch_table),
    ('docs/benchmarks.md', "a 16-bit training step adds autocast's {} casts to each, {} to the conv's", autocast_casts),
    ('docs/benchmarks.md', """a stride-1 training step {} + {} -> {} + {}, eval {} + {} -> {} + {}""",
     lambda: (lambda a, b: [a[('c4 256ch', 'train f32')]['aten'], a[('c4 256ch', 'train f32')]['triton'],
                            b[('c4 256ch', 'train f32')]['aten'], b[('c4 256ch', 'train f32')]['triton'],
                            a[('c4 256ch', 'eval f32')]['aten'], a[('c4 256ch', 'eval f32')]['triton'],
                            b[('c4 256ch', 'eval f32')]['aten'], b[('c4 256ch', 'eval f32')]['triton']])(
         *[{(r['shape'], r['mode']): r['backends']['triton_tc'] for r in d['rows']}
           for d in (at_commit('055a928', 'launches.json'), load('launches.json'))])),
]


def host_time_b7e5ec6():
    """The first host-time run (b7e5ec6+dirty), ``results/host_time.json`` as committed at 0401396: loads, then per
    row the custom operator's and the ``autograd.Function``'s median (min) and the ratio of medians."""
    d = at_commit('0401396', 'host_time.json')
    assert d['commit'].startswith('b7e5ec6') and d['commit'].endswith('+dirty'), d['commit']
    out = [d['load_before'][0], d['load_after'][0]]
    for i, r in enumerate(d['rows']):
        med, low = r['us_per_step'], r['min_us']
        out += [med['custom operator'], low['custom operator'], med['autograd.Function'], low['autograd.Function'],
                med['autograd.Function'] / med['custom operator']]
        if i == 0:
            out.append(low['autograd.Function'] / low['custom operator'])
    return out


FIGURES += [
    ('docs/benchmarks.md', """load {} -> {},
commit b7e5ec6+dirty (figures of code since changed: this run's JSON is `results/host_time.json` as committed at
0401396, in git history; the file now holds the 1d29a77 run below); median (min) us a step:

| backend, form | custom operator | `autograd.Function` | ratio of medians |
|---|---:|---:|---:|
| `triton_tc`, tiled (launches stubbed) | {} ({}) | {} ({}) | {} (min {}) |
| `cpu_kernel`, tiled | {} ({}) | {} ({}) | {} |
| `gemm`, dense | {} ({}) | {} ({}) | {} |""", host_time_b7e5ec6),
]


def sm90_table():
    """The sm_90 compile table, before (e58816d) -> after (ea780c4+dirty, ``sm90_kernels.json`` as committed at
    70d9b63): per shape and dtype the three kernels' registers, spilled bytes and ``cp.async`` counts; a cell that
    shows one figure for the three shows their common value."""
    before = load('sm90_kernels_e58816d.json')
    after = at_commit('70d9b63', 'sm90_kernels.json')
    assert before['commit'] == 'e58816d' and after['commit'].startswith('ea780c4'), after['commit']
    assert after['commit'].endswith('+dirty'), after['commit']
    kernels = ('tc_rows', 'tc_rows (logit grad)', 'tc_value_grad')

    def three(d, shape, dtype, key):
        rows = {r['kernel']: r for r in d['rows'] if r['shape'] == shape and r['dtype'] == dtype
                and r['precision'] == ('tf32' if dtype == 'fp32' else 'ieee')}
        return [rows[k][key] for k in kernels]

    def one(values):
        assert len(set(values)) == 1, values
        return [values[0]]
    out = []
    for shape in ('c4', 'c5_s2', 'c5'):
        for dtype in ('bf16', 'fp32'):
            b, a = (lambda key: three(before, shape, dtype, key)), (lambda key: three(after, shape, dtype, key))
            out += b('registers') + a('registers') + b('spill_stores') + one(a('spill_stores'))
            out += one(b('cp_async')) + one(a('cp_async')) if dtype == 'bf16' else b('cp_async') + a('cp_async')
    return out


FIGURES += [
    ('docs/benchmarks.md', """| c4 | bf16 | tc_rows / logit grad / tc_value_grad | {} / {} / {} -> {} / {} / {} |
{} / {} / {} -> {} | {} -> {} |
| c4 | fp32 (TF32) | the same | {} / {} / {} -> {} / {} / {} | {} / {} / {} -> {} |
{} / {} / {} -> {} / {} / {} |
| c5, stride 2 | bf16 | the same | {} / {} / {} -> {} / {} / {} | {} / {} / {} -> {} | {} -> {} |
| c5, stride 2 | fp32 (TF32) | the same | {} / {} / {} -> {} / {} / {} | {} / {} / {} -> {} |
{} / {} / {} -> {} / {} / {} |
| c5 | bf16 | the same | {} / {} / {} -> {} / {} / {} | {} / {} / {} -> {} | {} -> {} |
| c5 | fp32 (TF32) | the same | {} / {} / {} -> {} / {} / {} | {} / {} / {} -> {} |
{} / {} / {} -> {} / {} / {} |""",
     sm90_table),
]


def _run3_tables():
    """Run 3's layer tables by (dtype, batch, mode, triton)."""
    d = load('gpu_h200_lambda_layer_triton.json')
    assert d['commit'] == '8ed91f4', d['commit']
    return {(x['settings']['dtype'], x['settings']['batch'], x['settings']['mode'], x['triton']): x['results']
            for x in d['tables']}


def run3_layer_table():
    """Run 3's table: per shape the conv's medians of the two tables (a range, or one figure where they round
    alike), the GEMM path's and Triton's ms, x their conv, MiB; the totals (training, then eval)."""
    tabs = _run3_tables()
    out = []
    for batch, single in ((1, (2,)), (8, (2,))):
        gemm, tri = tabs[('float32', batch, 'train', False)], tabs[('float32', batch, 'train', True)]
        for i in range(3):
            convs = sorted([gemm[i]['conv3x3']['ms'], tri[i]['conv3x3']['ms']])
            if i in single:
                assert round(convs[0], 1) == round(convs[1], 1), convs
                convs = convs[:1]
            out += convs
            for r in (gemm[i], tri[i]):
                out += [r['auto']['ms'], r['auto']['ms'] / r['conv3x3']['ms'], r['auto']['peak_mib']]
        out += [_summed(gemm), _summed(tri), _summed(tabs[('float32', batch, 'eval', False)]),
                _summed(tabs[('float32', batch, 'eval', True)])]
    return out


def _tmacs(rows, key):
    return [r[key]['gmac_per_s'] / 1000 for r in rows]


FIGURES += [
    ('docs/benchmarks.md', """| 256 ch 64x64 | 1, training | {}-{} | {} ({}x), {} MiB | {} ({}x), {} MiB |
| 512 ch 64x64 s2 | 1, training | {}-{} | {} ({}x), {} MiB | {} ({}x), {} MiB |
| 512 ch 32x32 | 1, training | {} | {} ({}x), {} MiB | {} ({}x), {} MiB |
| **total** | 1, training | | **{}x** | **{}x** |
| total | 1, eval | | {}x | {}x |
| 256 ch 64x64 | 8, training | {}-{} | {} ({}x), {} MiB | {} ({}x), {} MiB |
| 512 ch 64x64 s2 | 8, training | {}-{} | {} ({}x), {} MiB | {} ({}x), {} MiB |
| 512 ch 32x32 | 8, training | {} | {} ({}x), {} MiB | {} ({}x), {} MiB |
| **total** | 8, training | | **{}x** | **{}x** |
| total | 8, eval | | {}x | {}x |""", run3_layer_table),
    ('docs/benchmarks.md', """bfloat16 autocast (Triton, run 3): {}x / {}x the bfloat16 conv at batch 1
  (training / eval), {}x / {}x at batch 8""",
     lambda: [_summed(_run3_tables()[('bfloat16', b, m, True)]) for b in (1, 8) for m in ('train', 'eval')]),
    ('docs/benchmarks.md', """the conv {}-{} TMAC/s at batch 8 (TF32 tensor
  cores), the GEMM path {}-{}, Triton {}-{}""",
     lambda: (lambda t: (lambda c, g, r: [min(c), max(c), min(g), max(g), min(r), max(r)])(
         [x for m in ('train', 'eval') for tr in (False, True) for x in _tmacs(t[('float32', 8, m, tr)], 'conv3x3')],
         [x for m in ('train', 'eval') for x in _tmacs(t[('float32', 8, m, False)], 'auto')],
         [x for m in ('train', 'eval') for x in _tmacs(t[('float32', 8, m, True)], 'auto')]))(_run3_tables())),
]


def _gemm_before(name, commit):
    d = load(name)
    assert d['commit'] == commit, d['commit']
    tabs = {(x['settings']['batch'], x['settings']['mode']): x['results'] for x in d['tables']
            if x['settings']['dtype'] == 'float32' and x['precision'] == 'tf32'}
    return [_summed(tabs[k]) for k in ((1, 'train'), (8, 'train'), (8, 'eval'))]


def _triton_over_gemm(batch, mode):
    t = _run3_tables()
    return [r['auto']['ms'] / g['auto']['ms']
            for g, r in zip(t[('float32', batch, mode, False)], t[('float32', batch, mode, True)])]


FIGURES += [
    ('docs/benchmarks.md', """(run 1, same shapes, TF32): {}x the conv in training at batch 1, {}x at
  batch 8, {}x in eval at batch 8; run 2's GEMM path (whole-image chunks, one `F.fold`): {}x, {}x, {}x.""",
     lambda: _gemm_before('gpu_h200_lambda_layer_before.json', 'f83640c')
     + _gemm_before('gpu_h200_lambda_layer_fold.json', 'e36aae0')),
    ('docs/benchmarks.md', """Triton {}-{}x the GEMM path in training, {}-{}x in eval)""",
     lambda: [f(_triton_over_gemm(1, m)) for m in ('train', 'eval') for f in (min, max)]),
    ('docs/benchmarks.md', 'the GEMM path above ({}-{}x faster than Triton at batch 8)',
     lambda: (lambda r: [min(r), max(r)])(_triton_over_gemm(8, 'train') + _triton_over_gemm(8, 'eval'))),
]


def _run5_mmdet():
    m = load('gpu_h200_run5_check_mission_mmdet.json')
    steps = {s['name']: s for s in m['steps']}
    rc = m['results']['mask_rcnn']
    return [rc['iterations'], steps['mmdet_train']['seconds'], rc['losses']['first'], rc['losses']['last']]


FIGURES += [
    ('docs/benchmarks.md', """- **Tests**: the {} kernel tests passed at 8a76ab4""",
     lambda: [_run5_layer()['cuda_tests_kernels']['passed']]),
    ('docs/benchmarks.md', """through mmdet's own `tools/train.py`, {} iterations in
  {} s (loss {} -> {})""", _run5_mmdet),
    ('docs/benchmarks.md', """per shape at batch 8, TF32,
training: {} / {} / {}:""",
     lambda: [s['layer_ms'] / s['conv_ms'] for s in pick(_run5_layer()['layer_vs_conv'], execution='triton_tc',
                                                        dtype='float32', batch=8, mode='train')['shapes'].values()]),
    ('docs/benchmarks.md', """Peak training-step memory at 1024 px, batch 1: LambdaResNet-101 {} MiB, RS-101+SE {},
RS-101 without SE {}. Without SE""",
     lambda: [pick(load('gpu_h200_run5_models_backbone_b1.json'), comparison='backbone', batch=1)['peak_mib'][m]
              for m in ('LambdaResNet-101', 'ResNet-RS-101+SE', 'ResNet-RS-101 without SE')]),
    ('docs/benchmarks.md', 'above: {}x faster than eager for LambdaResNet-101 at\n1024 px)',
     lambda: (lambda g: [g['eager_ms'] / g['graphed_ms']])(
         cases(_run5_layer()['models']['models_graphs'][0]['rows'])['LambdaResNet-101 features 1024px'])),
]


def _run4_layer_ms(batch):
    r = load('gpu_h200_check_layer.json')['results']
    ms = [s['layer_ms'] for s in pick(r['layer_vs_conv'], execution='tensor_cores', dtype='float32', batch=batch,
                                      mode='train')['shapes'].values()]
    return [min(ms), max(ms)]


FIGURES += [
    ('docs/benchmarks.md', """all {} CUDA tests pass, strict (a kernel that fails to launch fails its test):
the {} kernel tests""",
     lambda: (lambda k, m: [k + m, k])(load('gpu_h200_check_layer.json')['results']['cuda_tests_kernels']['passed'],
                                       load('gpu_h200_cuda_tests_models.json')['tests'])),
    ('docs/benchmarks.md', 'and the {} model tests (a training step of every registered model',
     lambda: [load('gpu_h200_cuda_tests_models.json')['tests']]),
    ('docs/benchmarks.md', 'loss {} -> {} in the LSJ warm-up',
     lambda: (lambda x: [x['first'], x['last']])(
         load('gpu_h200_check_mission.json')['results']['mask_rcnn']['losses'])),
    ('docs/benchmarks.md', """At batch 8 the tensor-core layer takes {}-{} ms
a training step, hardly more than at batch 1 ({}-{} ms)""", lambda: _run4_layer_ms(8) + _run4_layer_ms(1)),
    ('docs/benchmarks.md', """Peak training-step memory at 1024 px, batch 1: LambdaResNet-101 {} MiB, RS-101+SE {},
RS-101 without SE {}.

What this says""",
     lambda: [load('gpu_h200_check_layer.json')['results']['models']['models_backbone_b1'][0]['peak_mib'][m]
              for m in ('LambdaResNet-101', 'ResNet-RS-101+SE', 'ResNet-RS-101 without SE')]),
    ('docs/benchmarks.md', 'halve the step here ({} -> {} ms, LambdaResNet-101 at 1024 px)',
     lambda: [cases(load('gpu_h200_graphs.json')['results'])['LambdaResNet-101 features 1024px'][k]
              for k in ('eager_ms', 'graphed_ms')]),
]


def table4_memory():
    """docs/table4.md's JSON columns per row: the paper's memory (where given), the analytic and measured memory,
    the paper's time ratio (where given), the parameters."""
    out = []
    for r in load('table4_memory.json')['rows']:
        out += ([r['paper_gb']] if r['paper_gb'] is not None else []) + [r['analytic_gib'], r['measured_gib']]
        out += ([r['paper_ratio']] if r['paper_ratio'] is not None and r['paper_ratio'] != 1.0 else [])
        out.append(r['params_m'])
    return out


FIGURES += [
    ('docs/table4.md', """| Global self-attention | `resnet50_global_attn` | Θ(blhm²) | {} | {} |
{} | OOM | 12.74 | 12.62 | 11.10 | {} | OOM |
| Axial self-attention | `resnet50_axial_attn` | Θ(blhn√n) | {} | {} | {} | {} | 0.90 | 1.23 | 0.79 | {} | 77.5 |
| Local self-attention (7x7) | `resnet50_local_attn7` | Θ(blhnm) | - | {} | {} | {} | 4.44 | 4.65 | 3.87 | {} | 77.4 |
| Lambda layer | `resnet50_lambda` | Θ(lkn²) | {} | {} | {} | 1.00 | 1.00 | 1.00 | 0.87 | {} | 78.4 |
| Lambda layer (\\|k\\|=8) | `resnet50_lambda_k8` | Θ(lkn²) | {} | {} | {} | {} | 0.97 | 0.95 | 0.85 | {} | 77.9 |
| Lambda layer (shared embeddings) | `resnet50_lambda_shared` | Θ(kn²) | {} | {} |
{} | {} | 0.98 | 1.01 | 0.86 | {} | 78 |
| Lambda convolution (7x7) | `resnet50_lambda_conv7` | Θ(lknm) | - | {} | {} | {} | 0.61 | 0.62 | 0.53 | {} | 78.1 |""",
     table4_memory),
    ('docs/attention_baselines.md', """global attention is {}x
the lambda layer's step memory already at batch 2, local attention {}x""",
     lambda: (lambda r: [r['Global self-attention']['measured_gib'] / r['Lambda layer']['measured_gib'],
                         r['Local self-attention (7x7)']['measured_gib'] / r['Lambda layer']['measured_gib']])(
         {x['layer']: x for x in load('table4_memory.json')['rows']})),
]


FIGURES += [
    ('docs/benchmarks.md', """LambdaResNet-101 /
  ResNet-RS-101+SE, backbone 1024 px, batch 4, float32 / bfloat16 (GEMM path) {} / {}, {} / {};
  LambdaResNet-50 / timm's `lambda_resnet50ts`, 224 px, batch 64, float32 / bfloat16 (Triton) {} / {},
  {} / {}.""",
     lambda: [x for d in ('torch.float32', 'torch.bfloat16')
              for x in both(pick(load('gpu_h200_models_fold.json')['results'], comparison='backbone', dtype=d),
                            'LambdaResNet-101', 'ResNet-RS-101+SE')]
     + [x for d in ('torch.float32', 'torch.bfloat16')
        for x in both(pick(load('gpu_h200_models_triton.json')['results'], comparison='classification', dtype=d),
                      'LambdaResNet-50', "timm's lambda_resnet50ts")]),
]


def _compile_before(commit, name):
    e = at_commit(commit, name)[0]
    lc, sc = 'LambdaResNet-101 compiled', 'ResNet-RS-101+SE compiled'
    first = e['first_step_s']
    return [_loads(e)[0], ratio(e, lc, sc), ratio(e, 'LambdaResNet-101 eager', sc),
            first['LambdaResNet-101'] / first['ResNet-RS-101+SE']]


def _onnx_before():
    return [ratio(e, f'LambdaResNet-101 {x}', f'ResNet-RS-101+SE {x}') for e in at_commit('51b30a7', 'onnx.json')
            for x in ('legacy', 'dynamo')]


FIGURES += [
    ('docs/benchmarks.md', """for ResNet-RS-101 + SE: **{}x**. The run of
2026-11-23 (the GEMM path, load {} before) gave {}x, eager {}x, first step {}x.""",
     lambda: compile_table('compile_512.json')[-1:] + _compile_before('4dd5b5d', 'compile_512.json')),
    ('docs/benchmarks.md', """The run of
2026-11-23 (the GEMM path, load {} before) gave {}x, eager {}x, first step {}x. Against""",
     lambda: _compile_before('51b30a7', 'compile_1024.json')),
    ('docs/benchmarks.md', """gave {}x / {}x at 224 px and {}x / {}x at
512 px (legacy / dynamo)""", _onnx_before),
    ('docs/benchmarks.md', """ONNX Runtime, legacy / dynamo exporter, a day before the run above (2026-11-23):
  {} / {} at 224 px, {} / {} at 512 px""", _onnx_before),
    ('docs/benchmarks.md', """LambdaResNet-101 against ResNet-RS-101 without SE: training {}x, inference {}x;
against its own conv twin {}x and {}x.""", lambda: (lambda b: both(b, 'LambdaResNet-101', 'ResNet-RS-101 without SE')
                      + both(b, 'LambdaResNet-101', 'LambdaResNet-101 conv twin'))(load('backbone_1024.json')[0])),
    ('docs/benchmarks.md', """({} and {} in the run above); against ResNet-RS-101 without SE 0.94x-1.05x
  in earlier runs ({}x / {}x above)""", lambda: (lambda b: both(b, 'LambdaResNet-101', 'ResNet-RS-101+SE')
                                                 + both(b, 'LambdaResNet-101', 'ResNet-RS-101 without SE'))(
         load('backbone_1024.json')[0])),
]


ISA_SHAPES = (('c4, 256 ch 64x64', 256, 64, 1), ('first c5, 512 ch 64x64 s2', 512, 64, 2),
              ('c5, 512 ch 32x32', 512, 32, 1))
ISA_STEPS = (('train', 'float32'), ('train', 'bfloat16'), ('eval', 'float32'), ('eval', 'bfloat16'))
ISA_CANDIDATES = ('cpu_kernel[native]', 'cpu_kernel[x86-64-v3]', 'gemm', 'auto[native]', 'auto[x86-64-v3]')
# What ``auto`` served in each row of the table, AVX-512 build and AVX2 build (shape-major, then ISA_STEPS).
ISA_SERVED = [('kernel', 'kernel')] * 5 + [('kernel', 'gemm'), ('kernel', 'kernel'), ('kernel', 'gemm')] + [
    ('kernel', 'kernel')] * 4


def _isa_passage():
    rows = []
    for (label, *_), served in zip([s for s in ISA_SHAPES for _ in ISA_STEPS], ISA_SERVED):
        step = ISA_STEPS[len(rows) % 4]
        rows.append(f'| {label} | {step[0]}, {step[1]} | {{}} | {{}} ({{}}x) | {{}} ({{}}x) | {{}} ({{}}x) | '
                    f'{{}} ({{}}x) {served[0]} | {{}} ({{}}x) {served[1]} |')
    rows += [f'| **3 shapes summed** | {m} {d} | 1 | **{{}}x** | **{{}}x** | **{{}}x** | **{{}}x** | **{{}}x** |'
             for m, d in ISA_STEPS]
    return '\n'.join(rows)


def isa_table():
    """tools/benchmark_cpu_isa.py's table: per row the conv's ms, each candidate's ms (x the conv), ``auto``'s
    backend as the page names it; then the summed ratios."""
    res = load('cpu_isa.json')
    rows = {(r['width'], r['size'], r['stride'], r['mode'], r['dtype']): r for r in res['results']}
    out, i = [], 0
    for _, w, s, st in ISA_SHAPES:
        for mode, dtype in ISA_STEPS:
            r = rows[(w, s, st, mode, dtype)]
            out.append(r['conv3x3']['ms'])
            for c in ISA_CANDIDATES:
                out += [r[c]['ms'], r[c]['ratio']]
            served = [{'cpu_kernel': 'kernel'}.get(b, b) for c in ISA_CANDIDATES[3:] for b in r[c]['served']]
            assert tuple(served) == ISA_SERVED[i], (served, ISA_SERVED[i])
            i += 1
    for mode, dtype in ISA_STEPS:
        out += [res['summed_ratio'][f'{mode} {dtype}'][c] for c in ISA_CANDIDATES]
    return out


FIGURES += [('docs/benchmarks.md', _isa_passage(), isa_table)]


def _isa_s2_bf16():
    r = [x for x in load('cpu_isa.json')['results'] if x['stride'] == 2 and x['mode'] == 'train'
         and x['dtype'] == 'bfloat16'][0]
    k, g = r['cpu_kernel[x86-64-v3]'], r['gemm']
    return [k['ratio'], g['ratio'], k['cpu_ratio'], g['cpu_ratio']]


FIGURES += [
    ('docs/benchmarks.md', """({}x the conv against the gemm backend's
{}x, CPU time {}x against {}x)""", _isa_s2_bf16),
    ('docs/benchmarks.md', '({}x / {}x summed for the two builds)',
     lambda: [_isa_summed('cpu_isa.json', 'train bfloat16, CPU time', k)
              for k in ('cpu_kernel[native]', 'cpu_kernel[x86-64-v3]')]),
]


def goal_table():
    """The model-level targets table: per goal the lambda layers' time, what the goal leaves them, their G
    multiply-adds, the rate needed and its share of the limit (``goal_budgets`` of the two runs' JSON)."""
    c4, bb = load('c4_512.json')[0]['goal_budgets'], load('backbone_1024.json')[0]['goal_budgets']
    out = []
    for g in c4 + bb:
        rate = g['lambda_gmacs'] / g['budget_s'] if g['budget_s'] > 0 else None
        out += [g['lambda_s']] + ([g['budget_s']] if g['budget_s'] > 0 else []) + [g['lambda_gmacs']]
        if rate is not None:
            out += [rate] + ([100 * rate / g['limit_gmac_per_s']] if rate > g['lambda_gmacs'] / g['lambda_s'] else [])
    return out


FIGURES += [
    ('docs/benchmarks.md', """| LambdaResNet-101-C4 <= 0.8x its conv twin | training step | {} | {} | {} | {} | {}% |
| LambdaResNet-101-C4 <= 0.8x its conv twin | inference | {} | {} | {} | {} | {}% |
| LambdaResNet-101 <= 0.9x RS-101 + SE | training step | {} (noise, see above) | < 0 | {} | out of reach | - |
| LambdaResNet-101 <= 0.92x RS-101 + SE | inference | {} | {} | {} | {} | {}% |
| LambdaResNet-101 <= 1.0x RS-101 without SE | training step | {} (noise) | {} | {} | {} | {}% |
| LambdaResNet-101 <= 1.0x RS-101 without SE | inference | {} | {} | {} | met ({}) | - |""", goal_table),
]


FIGURES += [
    ('docs/benchmarks.md', '`tools/dev/benchmarks/peak.py`: {} G multiply-adds/s on these two cores',
     lambda: [load('c4_512.json')[0]['goal_budgets'][0]['limit_gmac_per_s']]),
    ('docs/benchmarks.md', """ran at {} G multiply-adds/s in both modes
  ({} G in {} s, {} G in {} s: {}% of the limit)""",
     lambda: (lambda t, e: [t['lambda_gmacs'] / t['lambda_s'], t['lambda_gmacs'], t['lambda_s'], e['lambda_gmacs'],
                            e['lambda_s'], 100 * t['lambda_gmacs'] / t['lambda_s'] / t['limit_gmac_per_s']])(
         *load('c4_512.json')[0]['goal_budgets'])),
]


SWEEP_23 = """| 3x3 conv | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |
| dense | **{}** | **{}** | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |
| tiled | {} | {} | **{}** | **{}** | **{}** | **{}** | **{}** | **{}** | **{}** | **{}** | **{}** | **{}** |"""
SWEEP_7 = """| 3x3 conv | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |
| dense | **{}** | ~{} | ~{} | {} | {} | {} | {} | {} | {} | {} |
| tiled | {} | ~{} | ~{} | **{}** | **{}** | **{}** | **{}** | **{}** | **{}** | **{}** |"""


def sweep(name, passage, sizes):
    """The auto rule's sweep table: medians of the conv, dense and tiled forms at each size; the page's marks (bold:
    the form whose median beats the other's fastest round; ~: within each other's spread) must follow from the
    JSON."""
    rows = {r['size']: r for r in load(name)['results']}
    marks = re.findall(r'(\*\*\{\}\*\*|~\{\}|\{\})', passage.split('\n', 1)[1])
    out = [rows[s]['conv3x3']['ms'] for s in sizes]
    for i, form in enumerate(('dense', 'tiled')):
        other = ('tiled', 'dense')[i]
        for j, s in enumerate(sizes):
            a, b = rows[s][form], rows[s][other]
            want = '**{}**' if a['ms'] < b['min_ms'] else '{}' if b['ms'] < a['min_ms'] else '~{}'
            assert marks[i * len(sizes) + j] == want, (name, form, s, marks[i * len(sizes) + j], want)
            out.append(a['ms'])
    return out


FIGURES += [
    ('docs/benchmarks.md', SWEEP_23,
     lambda: sweep('sweep_scope23.json', SWEEP_23, (8, 12, 14, 16, 18, 20, 22, 24, 28, 32, 40, 48))),
    ('docs/benchmarks.md', SWEEP_7,
     lambda: sweep('sweep_scope7_u4.json', SWEEP_7, (5, 6, 7, 8, 9, 10, 12, 14, 16, 20))),
]


def _run4_tests():
    return [load('gpu_h200_check_layer.json')['results']['cuda_tests_kernels']['passed']
            + load('gpu_h200_cuda_tests_models.json')['tests']]


FIGURES += [
    ('docs/install.md', """(2026-11-27, at 069be9b, the
tensor-core kernels): {} passed""", _run4_tests),
    ('docs/execution_modes.md', """(run 5, 2026-11-27, at 8a76ab4: the {} kernel tests passed; the model tests
last ran in run 4, {} of {})""", lambda: [_run5_layer()['cuda_tests_kernels']['passed']]
     + (lambda m: [m['tests'] - m['failures'] - m['errors'], m['tests']])(load('gpu_h200_cuda_tests_models.json'))),
]


# Earlier runs of the backbone and C4 commands: (the version of the JSON in git history, the commit the page names).
BACKBONE_EARLIER = [('4942607', '3a80e2c'), ('f3a9c75', '5337708'), ('0196dd1', '876ac7a'), ('9a9be92', '66cc058'),
                    ('7732ac4', '2d201d3')]
C4_EARLIER = [('4942607', '3a80e2c'), ('66abbb4', '761c799'), ('0196dd1', '876ac7a'), ('9a9be92', '66cc058'),
              ('7732ac4', '2d201d3')]


def earlier(name, versions, a, b, memory_at=None):
    out = []
    for version, _ in versions:
        e = at_commit(version, name)[0]
        out += both(e, a, b) + ([e['peak_mib'][a]] if version == memory_at else [])
    return out


FIGURES += [
    ('docs/benchmarks.md', """2026-11-25 at b26304f's kernel (the backward's logit gradients by query
lanes), AMD EPYC family 25 model 17 (Zen 4, the kernel's AVX-512 build), load {} before, {} after the timing""",
     lambda: _loads(load('backbone_1024.json')[0])),
    ('docs/benchmarks.md', """(2026-11-25, the same kernel,
load {} before, {} after the timing)""", lambda: _loads(load('c4_512.json')[0])),
    ('docs/benchmarks.md', """training {}x /
inference {}x RS-101 + SE at 3a80e2c, {}x / {}x at 5337708 (the same morning), {}x / {}x at 876ac7a,
{}x / {}x at 66cc058, {}x / {}x at 2d201d3 (the GEMM path).""",
     lambda: earlier('backbone_1024.json', BACKBONE_EARLIER, 'LambdaResNet-101', 'ResNet-RS-101+SE')),
    ('docs/benchmarks.md', """Earlier runs: {}x / {}x at 3a80e2c (the content lambda inside the kernel),
{}x / {}x at 761c799, {}x / {}x at 876ac7a (blocked operands, {} MiB), {}x / {}x at 66cc058 (the first kernel),
{}x / {}x at 2d201d3 (the GEMM path).""",
     lambda: earlier('c4_512.json', C4_EARLIER, 'LambdaResNet-101-C4', 'LambdaResNet-101-C4 conv twin', '0196dd1')),
]


def layer_at(version, name='lambda_layer.json', loads=False):
    """An earlier layer run (the JSON in git history): the three shapes' ratios to the conv and the summed one;
    with ``loads``, its load before first."""
    d = at_commit(version, name)
    rows = d['results'] if isinstance(d, dict) else d
    out = [float(d['load_before'].split()[0])] if loads else []
    return out + [r['auto']['ms'] / r['conv3x3']['ms'] for r in rows] + [_summed(rows)]


FIGURES += [
    ('docs/benchmarks.md', """the run at afff4a2, before
the change below, {}x ({}x / {}x / {}x), with the stride-2 layer at {} ms""",
     lambda: (lambda r: [r[3], *r[:3]])(layer_at('afff4a2'))
     + [at_commit('afff4a2', 'lambda_layer.json')['results'][1]['auto']['ms']]),
    ('docs/benchmarks.md', """That run
  (0ab16d8, load {} / {} before): training {}x / {}x / {}x, eval {}x / {}x / {}x.""",
     lambda: [layer_at('960a30f', loads=True)[0], layer_at('960a30f', 'lambda_layer_eval.json', True)[0]]
     + layer_at('960a30f')[:3] + layer_at('960a30f', 'lambda_layer_eval.json')[:3]),
    ('docs/benchmarks.md', """The run before (3a80e2c, load {} / {} before): training {}x / {}x / {}x, total {}x;
eval {}x / {}x / {}x, total {}x.""",
     lambda: [layer_at('4942607', loads=True)[0], layer_at('4942607', 'lambda_layer_eval.json', True)[0]]
     + layer_at('4942607') + layer_at('4942607', 'lambda_layer_eval.json')),
    ('docs/benchmarks.md', """Before that (5337708, the same kernel without the content lambda, load {} / {}):
training {}x / {}x / {}x, total {}x; eval {}x / {}x / {}x, total {}x;""",
     lambda: [layer_at('f3a9c75', loads=True)[0], layer_at('f3a9c75', 'lambda_layer_eval.json', True)[0]]
     + layer_at('f3a9c75') + layer_at('f3a9c75', 'lambda_layer_eval.json')),
    ('docs/benchmarks.md', """at 761c799
(2026-11-24, the same kernel) {}x / {}x / {}x and {}x training, {}x / {}x / {}x and {}x eval; at
876ac7a (blocked operands) {}x / {}x / {}x and {}x training, {}x / {}x / {}x and {}x eval; at
0dd9084 (before the kernel skipped the scope offsets that meet padding) {}x / {}x / {}x and {}x training,
{}x / {}x / {}x and {}x eval; at 66cc058 (the first kernel) {}x / {}x / {}x and {}x, {}x / {}x
/ {}x and {}x.""",
     lambda: [x for v in ('66abbb4', '0196dd1', '159bc27', '9a9be92')
              for x in layer_at(v) + layer_at(v, 'lambda_layer_eval.json')]),
    ('docs/benchmarks.md', """The run of 2026-11-24 at 2d201d3 (the GEMM path, 15 rounds, load {}-{}) gave
{}x / {}x / {}x and {}x in total for training, {}x / {}x / {}x and {}x for eval; the run of 2026-11-23 (older code,
training only, `--repeats 7`, load {}) {}x / {}x / {}x and {}x.""",
     lambda: sorted([layer_at('7732ac4', loads=True)[0], layer_at('7732ac4', 'lambda_layer_eval.json', True)[0]])
     + layer_at('7732ac4') + layer_at('7732ac4', 'lambda_layer_eval.json') + layer_at('589606d', loads=True)),
]


def _shares(files, version=None):
    """The limit and the conv's and the layer's share of it (min, max, %) over the training and eval runs."""
    data = [load(f) if version is None else at_commit(version, f) for f in files]
    rows = [r for d in data for r in d['results']]
    c = [100 * r['conv3x3']['share_of_fma_peak'] for r in rows]
    lam = [100 * r['auto']['share_of_fma_peak'] for r in rows]
    return [statistics.mean(d['fma_peak_gmac_per_s'] for d in data), min(c), max(c), min(lam), max(lam)]


FIGURES += [
    ('docs/benchmarks.md', """In the runs at 3a80e2c (`results/lambda_layer*.json` as committed at 4942607,
figures of code since changed) it was **{} G multiply-adds/s** on the two threads""",
     lambda: _shares(('lambda_layer.json', 'lambda_layer_eval.json'), '4942607')[:1]),
    ('docs/benchmarks.md', """convolution reached {}-{}% of it, the lambda layer as a whole {}-{}%
({}-{}% before the content lambda moved into the kernel). In the table's runs: {} G/s, the conv {}-{}%,
the layer {}-{}%.""",
     lambda: _shares(('lambda_layer.json', 'lambda_layer_eval.json'), '4942607')[1:]
     + _shares(('lambda_layer.json', 'lambda_layer_eval.json'), 'f3a9c75')[3:]
     + _shares(('lambda_layer.json', 'lambda_layer_eval.json'))),
    ('docs/benchmarks.md', """at 3a80e2c, load {} / {} before; not re-run at
0ab16d8): training {}x / {}x /
{}x (total {}x), eval {}x / {}x / {}x ({}x); the run before: {}x / {}x / {}x and {}x / {}x /
{}x.""",
     lambda: [float(load(f)['load_before'].split()[0]) for f in ('lambda_layer_512.json',
                                                                  'lambda_layer_512_eval.json')]
     + (lambda a, b: a[:3] + [a[3]] + b[:3] + [b[3]])(layer_at('4942607', 'lambda_layer_512.json'),
                                                     layer_at('4942607', 'lambda_layer_512_eval.json'))
     + layer_at('f3a9c75', 'lambda_layer_512.json')[:3] + layer_at('f3a9c75', 'lambda_layer_512_eval.json')[:3]),
]


def _sm90_now(kernel, warps, strides=('c4', 'c5'), dtypes=('bf16',)):
    d = at_commit('1d29a77', 'sm90_kernels.json')  # (7e0a69a+dirty's kernels; the file now holds issue 53's)
    assert d['commit'].startswith('7e0a69a') and d['commit'].endswith('+dirty'), d['commit']
    rows = [r for r in d['rows'] if r['kernel'] == kernel and r['shape'] in strides and r['dtype'] in dtypes
            and r['num_warps'] == warps]
    assert rows and not any(r['spill_stores'] for r in rows), rows
    return [min(r['registers'] for r in rows), max(r['registers'] for r in rows)]


FIGURES += [
    ('docs/benchmarks.md', """none at 8 ({}-{} registers, `wgmma`), the value gradient
  up to 220 at 4 (likewise), none at 8 ({}-{} registers)""",
     lambda: _sm90_now('tc_rows', 8) + _sm90_now('tc_value_grad', 8)),
    ('docs/benchmarks.md', 'with its fused `dq` spills\n  nothing on 4 ({}-{} registers)',
     lambda: _sm90_now('tc_rows (logit grad)', 4, ('c4', 'c5', 'odd'), ('bf16', 'fp16', 'fp32'))),
    ('docs/benchmarks.md', 'two multiply-adds per float32 lane, {}-{} G multiply-adds/s here',
     lambda: (lambda g: [min(g), max(g)])(
         [r['conv3x3']['gmac_per_s'] for f in BF16_LAYER for r in load(f)['results']])),
    ('docs/benchmarks.md', """The multiply-adds per step (same tool): conv {} G training / {} G eval at every shape;
the lambda layer {} / {} G (c4), {} / {} G (stride 2), {} / {} G (c5)""",
     lambda: (lambda t, e: [t[0]['conv3x3']['gmacs'], e[0]['conv3x3']['gmacs']]
              + [x for a, b in zip(t, e) for x in (a['auto']['gmacs'], b['auto']['gmacs'])])(
         load('lambda_layer.json')['results'], load('lambda_layer_eval.json')['results'])),
]


def _top(dtype):
    """Run 5's profile at c4: the layer's kernels by name, ms."""
    p = [x for x in _run5_layer()['tc_kernels']['profile'] if x['shape'] == 'c4' and x['module'] == 'lambda'
         and x['dtype'] == dtype][0]
    return {k: v / 1000 for k, v in p['top'].items()}


def run5_profile_c4():
    bf, tf = _top('bfloat16'), _top('float32')
    gemms = [v for k, v in bf.items() if not k.startswith('_tc')]
    magma = [v for k, v in bf.items() if 'magma_sgemmEx' in k]
    ffma = [v for k, v in tf.items() if 'ffma' in k]
    assert len(gemms) == 3 and len(magma) == 1 and len(ffma) == 1
    wall = pick(_run5_layer()['layer_vs_conv'], execution='triton_tc', dtype='float32', batch=8,
                mode='train')['shapes']['256ch 64px s1']['layer_ms']
    return [wall, bf['_tc_rows'], bf['_tc_value_grad'], sum(gemms), magma[0], ffma[0]]


FIGURES += [
    ('docs/benchmarks.md', """device time ({} ms at c4): the host is still the larger bound.
At c4 in bf16: `_tc_rows` {} ms (two chunks, of 7 and 1 images, forward and logit gradient), `_tc_value_grad` {},
and the three GEMMs on the 529-wide query-major logits {} ms on unaligned kernels (cuBLAS's `magma_sgemmEx` for
`dR`, {}; cutlass `align1` for the logits and `dq`); in TF32 an FFMA (not tensor-core) GEMM {} ms""",
     run5_profile_c4),
]


def _spills_8fc48ad():
    d = at_commit('946643e', 'sm90_kernels.json')
    assert d['commit'].startswith('8fc48ad'), d['commit']
    s = [r['spill_stores'] for r in d['rows'] if r['kernel'] == 'tc_value_grad' and r['spill_stores']]
    assert {r['shape'] for r in d['rows'] if r['spill_stores']} == {'c5', 'c5_s2'}
    return [min(s), max(s)]


FIGURES += [
    ('docs/benchmarks.md', 'it spilled {}-{} bytes a thread at |v| = 128 (c5, c5 stride 2)', _spills_8fc48ad),
    ('docs/benchmarks.md', '128 spilled {}-{}\nbytes a thread at 8fc48ad', _spills_8fc48ad),
    ('docs/benchmarks.md', 'compiles every kernel too, at most {} bytes spilled ({} in the 16-bit fused forward)',
     lambda: (lambda rows: [max(r['spill_stores'] for r in rows),
                            max(r['spill_stores'] for r in rows if r['kernel'] == 'tc_rows'
                                and r['dtype'] in ('bf16', 'fp16') and r['shape'] != 'c5_s2')])(
         load('sm90_kernels_triton36.json')['rows'])),
]


def _sweep_us(kernel, shape):
    """Run 5's sweep, bfloat16: microseconds of the 64-row and the 16-row program (4 warps, default stages)."""
    rows = member('gpu_h200_run5_check_layer_logs.tar.gz', 'layer_files/tune_tc_kernels.json')['rows']
    r = [x for x in rows if x['part'] == 'sweep' and x['kernel'] == kernel and x['shape'] == shape
         and x['dtype'] == 'bfloat16'][0]
    us = {c['config']['BLOCK_Q'] * c['config']['BLOCK_H']: 1000 * c['ms'] for c in r['configs']
          if c['config']['num_warps'] == 4 and 'num_stages' not in c['config']}
    return [us[64], us[16]]


def _one_stage():
    """Run 5's sweep: the float32 rows kernels (forward and logit gradient) with one pipeline stage against the
    default, all six; then the range of those at 1.10x or more, which must be three."""
    s = sorted(_sweep(lambda r, c: r['kernel'].startswith('tc_rows') and r['dtype'] == 'float32'
                      and c.get('num_stages') == 1 and c['num_warps'] == 4, each=True))
    fast = [x for x in s if x >= 1.095]
    assert len(s) == 6 and len(fast) == 3, s
    return [s[0], s[-1], fast[0], fast[-1]]


FIGURES += [
    ('docs/benchmarks.md', 'float32 rows with one pipeline stage {}-{}x ({}-{}x in three of the six)', _one_stage),
    ('docs/benchmarks.md', 'pipelining the float32 loads cost up to {}x', lambda: _one_stage()[1:2]),
    ('docs/benchmarks.md', 'ran as fast as 16 rows in bf16 (c4 {} / {} us; c5 logit gradient {} /\n{} us)',
     lambda: _sweep_us('tc_rows', 'c4') + _sweep_us('tc_rows (logit grad)', 'c5')),
]


def _bf16_float32_kernel():
    """The first bfloat16 layer runs (2026-11-25, the float32 kernel at stride 1, the GEMM path at stride 2): the
    files as committed at 4de371c, 1024 and 512 px training."""
    return [_summed(at_commit('4de371c', f)['results'])
            for f in ('lambda_layer_bf16.json', 'lambda_layer_512_bf16.json')]


FIGURES += [
    ('docs/benchmarks.md', '| the same before (2026-11-25, float32 kernel / GEMM path) | {}x | - | {}x |',
     _bf16_float32_kernel),
    ('docs/benchmarks.md', 'on 2026-11-25 the float32 kernel at stride 1 ({}x / {}x)', _bf16_float32_kernel),
    ('docs/benchmarks.md', '{}x (1024 px) and {}x (512 px) in training when the kernel\n  widened bfloat16 to float32',
     _bf16_float32_kernel),
]


FIGURES += [
    ('docs/benchmarks.md', """What this says for the lambda-layer issue's targets: the layer is at {}-{}x the conv
(target <= 1.0x each, 0.8x summed), {}x graphed; the C4 model at {}x (target 1.3x), {}x graphed;
the backbone at {}x / {}x RS-101+SE""",
     lambda: (lambda tc, m: [min(tc), max(tc), graphs(load('gpu_h200_graphs.json')['results'], 'graphed_ms'),
                             m[11], m[13], m[0], m[1]])(run4_layer_table()[:4], run4_models())),
    ('docs/benchmarks.md', """training at 2e023c2 (the query and table gradients from the lane-form
logit gradients, below), load {} before; eval at 69bb5ed (the forward is the same since), load {} before.""",
     lambda: [float(load(f)['load_before'].split()[0]) for f in ('lambda_layer.json', 'lambda_layer_eval.json')]),
]


FIGURES += [
    ('docs/benchmarks.md', '(the step,\ncompile and capture included, {} s)',
     lambda: [s['seconds'] for s in load('gpu_h200_run5_check_mission.json')['steps']
              if s['name'] == 'models_reduce_overhead']),
]


FIGURES += [
    ('docs/benchmarks.md', 'about {} ms of a {} ms step',
     lambda: [run5_profile_c4()[5], [p for p in _run5_layer()['tc_kernels']['profile'] if p['shape'] == 'c4'
                                     and p['module'] == 'lambda' and p['dtype'] == 'float32'][0]['device_us'] / 1000]),
]


def runs_1_to_3_baselines():
    """How far the baselines' medians moved: run 3 against run 2 (largest but the bfloat16 backbone's inference, then
    that one) and run 1's bfloat16 backbone against run 2's, training and inference, in %."""
    runs = [load(f'gpu_h200_models_{n}.json')['results'] for n in ('before', 'fold', 'triton')]

    def med(run, comparison, dtype, mode):
        base = 'ResNet-RS-101+SE' if comparison == 'backbone' else "timm's lambda_resnet50ts"
        return statistics.median(pick(run, comparison=comparison, dtype=dtype)['times'][f'{base}/{mode}'])
    keys = [(c, d, m) for c in ('backbone', 'classification') for d in ('torch.float32', 'torch.bfloat16')
            for m in ('training step', 'inference')]
    moved = {k: 100 * abs(med(runs[2], *k) / med(runs[1], *k) - 1) for k in keys}
    odd = ('backbone', 'torch.bfloat16', 'inference')
    return [max(v for k, v in moved.items() if k != odd), moved[odd]] + [
        100 * (med(runs[0], 'backbone', 'torch.bfloat16', m) / med(runs[1], 'backbone', 'torch.bfloat16', m) - 1)
        for m in ('training step', 'inference')]


FIGURES += [
    ('docs/benchmarks.md', """agree between runs 2 and 3 within {}%
(the bfloat16 backbone's inference: {}%), run 1's bfloat16 backbone baseline was {}% slower in training ({}% in
inference).""", runs_1_to_3_baselines),
]


def _peak(version, name='lambda_layer.json', shapes=(0, 1, 2)):
    """The layer's peak memory (MiB) per shape, in the JSON as it is or as committed at ``version``."""
    rows = (load(name) if version is None else at_commit(version, name))['results']
    return [rows[i]['auto']['peak_mib'] for i in shapes]


FIGURES += [
    ('docs/benchmarks.md', 'Peak memory unchanged ({} / {} / {} MiB)', lambda: _peak(None)),
    ('docs/benchmarks.md', "The layer's training-step peak memory: {} / {} / {} MiB (was {} / {} / {})",
     lambda: _peak('afff4a2') + _peak('960a30f')),
    ('docs/benchmarks.md', "peak memory fell from {} / {} / {} MiB to {} / {} / {} MiB",
     lambda: _peak('4942607') + _peak('960a30f')),
    ('docs/benchmarks.md', 'eval peak memory of the lambda layer {} / {} / {} MiB',
     lambda: _peak('f3a9c75', 'lambda_layer_eval.json')),
    ('docs/benchmarks.md', 'c4 {} -> {} MiB, c5 {} -> {})',
     lambda: [x for i in (0, 2) for x in _peak('f3a9c75', 'lambda_layer_eval.json', (i,))
              + _peak('4942607', 'lambda_layer_eval.json', (i,))]),
]


def _isa_s2_f32():
    """The stride-2 float32 training row in the capped-libraries run and the run above: the AVX2 kernel's ratio,
    the AVX-512 build's, and the AVX2 build's time over the AVX-512 build's (its range over the two runs)."""
    out, rel = [], []
    for f in ('cpu_isa_avx2_libraries.json', 'cpu_isa.json'):
        r = [x for x in load(f)['results'] if x['stride'] == 2 and x['mode'] == 'train' and x['dtype'] == 'float32'][0]
        out.append((r['cpu_kernel[x86-64-v3]']['ratio'], r['cpu_kernel[native]']['ratio']))
        rel.append(r['cpu_kernel[x86-64-v3]']['ms'] / r['cpu_kernel[native]']['ms'])
    (a2, a5), (b2, b5) = out
    return [a2, b2, a5, b5, min(rel), max(rel)]


FIGURES += [
    ('docs/benchmarks.md', """The stride-2 shape's
{}x is {}x in the run above: between the two runs the AVX-512 build moved the same way there ({}x against
{}x), the AVX2 build staying {}-{}x the AVX-512 one at that shape in both.""", _isa_s2_f32),
]


def _isa_loads(name):
    d = load(name)
    loads = [float(d['load_before'].split()[0]), float(d['load_after'].split()[0])]
    return [min(loads), max(loads)]


FIGURES += [
    ('docs/benchmarks.md', 'The machine was shared: load {}-{} on 2 cores throughout',
     lambda: _isa_loads('cpu_isa.json')),
    ('docs/benchmarks.md', '--json docs/results/cpu_isa_avx2_libraries.json`, the same session, load\n{}-{}), float32',
     lambda: _isa_loads('cpu_isa_avx2_libraries.json')),
    ('docs/benchmarks.md', 'backend at every shape, within {}x of the AVX-512 build',
     lambda: [max(r['cpu_kernel[x86-64-v3]']['ms'] / r['cpu_kernel[native]']['ms']
                  for r in load('cpu_isa.json')['results'] if r['mode'] == 'train' and r['dtype'] == 'float32')]),
]


def _isa_rows(name, mode, dtype, candidate, key='ratio'):
    """tools/benchmark_cpu_isa.py's ratios of one candidate to the conv at the three shapes."""
    return [r[candidate][key] for r in load(name)['results'] if r['mode'] == mode and r['dtype'] == dtype]


def _isa_dated(date, commit):
    """The README's date and commit for the per-instruction-set run are its JSON's (no figures)."""
    d = load('cpu_isa.json')
    assert d['date'].startswith(date) and d['commit'].startswith(commit) and d['commit'].endswith('+dirty'), d
    return []


def _isa_summed(name, setting, candidate):
    return load(name)['summed_ratio'][setting][candidate]


def _programs_per_sm(r):
    """Programs resident on an sm_90 multiprocessor, as tools/sm90_kernels.py's ``programs_per_sm`` (registers 8 a
    thread at a time of 65536, 64 warps, 228 KiB of shared memory with 1 KiB a block reserved, 32 blocks): for the
    rows of a JSON from before the tool recorded it."""
    by_shared = 228 * 1024 // (r['shared'] + 1024) if r['shared'] else 32
    return min(65536 // (-(-r['registers'] // 8) * 8 * 32 * r['num_warps']), 64 // r['num_warps'], by_shared, 32)


def issue53_macs():
    """Issue 53's multiply-add table: the training step's issued / needed before (kernel_macs.json at 84cc348) and
    after (now), bf16 and TF32, and the floor (pruned logits; whole logits), per shape."""
    before, after = at_commit('84cc348', 'kernel_macs.json'), load('kernel_macs.json')
    out = []
    for shape in ('c4', 'c5_s2', 'c5'):
        b = {r['dtype']: r for r in before['rows'] if r['shape'] == shape}
        a = {r['dtype']: r for r in after['rows'] if r['shape'] == shape}
        out += [b['bfloat16']['ratio']['train'], b['tf32']['ratio']['train'], a['bfloat16']['ratio']['train'],
                a['tf32']['ratio']['train'], a['bfloat16']['floor']['train'], a['bfloat16']['floor']['whole_logits']]
    return out


def issue53_c4_kernels():
    """c4, bf16: each kernel's issued / needed before and after, and the floor's parts."""
    before, after = at_commit('84cc348', 'kernel_macs.json'), load('kernel_macs.json')
    b = [r for r in before['rows'] if r['shape'] == 'c4' and r['dtype'] == 'bfloat16'][0]['kernels']
    row = [r for r in after['rows'] if r['shape'] == 'c4' and r['dtype'] == 'bfloat16'][0]
    a = row['kernels']
    names = ('forward tc_rows', 'backward tc_rows (logit grad)', 'backward tc_value_grad')
    return ([x for n in names for x in (b[n]['ratio'], a[n]['ratio'])] + [a['backward gemm logits Q E']['ratio']]
            + [row['floor'][k] for k in ('rows', 'value_grad', 'logits')])


def issue53_sm90():
    """Issue 53's sm_90 table: per shape and dtype (bf16, TF32) the three kernels' registers and programs a
    multiprocessor before (sm90_kernels.json at 1d29a77, 7e0a69a+dirty) and after (now), the value gradient's wgmma
    instructions before and after, and the three kernels' cp.async after."""
    before, after = at_commit('1d29a77', 'sm90_kernels.json'), load('sm90_kernels.json')
    assert before['commit'].startswith('7e0a69a'), before['commit']
    kernels = ('tc_rows', 'tc_rows (logit grad)', 'tc_value_grad')

    def three(d, shape, dtype, key):
        rows = {r['kernel']: r for r in d['rows'] if r['shape'] == shape and r['dtype'] == dtype
                and r['precision'] == ('tf32' if dtype == 'fp32' else 'ieee')}
        return [key(rows[k]) for k in kernels]
    out = []
    for shape in ('c4', 'c5_s2', 'c5'):
        for dtype in ('bf16', 'fp32'):
            b, a = (lambda key: three(before, shape, dtype, key)), (lambda key: three(after, shape, dtype, key))
            assert not any(a(lambda r: r['spill_stores'] + r['spill_loads']))
            out += b(lambda r: r['registers']) + a(lambda r: r['registers'])
            out += b(_programs_per_sm) + a(lambda r: r['programs_per_sm'])
            out += [b(lambda r: r['wgmma'])[2], a(lambda r: r['wgmma'])[2]] + a(lambda r: r['cp_async'])
    return out


_ISSUE53_ROW = '{} / {} / {} -> {} / {} / {} | {} / {} / {} -> {} / {} / {} | {} -> {} | {} / {} / {} |'

FIGURES += [
    ('docs/benchmarks.md', """| shape | before (bf16 / TF32) | after (bf16 / TF32) | floor (whole logits) |
|---|---:|---:|---:|
| c4 | {} / {} | {} / {} | {} ({}) |
| c5, stride 2 | {} / {} | {} / {} | {} ({}) |
| c5 | {} / {} | {} / {} | {} ({}) |""", issue53_macs),
    ('docs/benchmarks.md', """At c4 in bf16 the forward went from {}x to {}x, the logit gradient from {}x to
{}x, the value gradient from {}x to {}x (plus its logits GEMM, {}x)""", lambda: issue53_c4_kernels()[:7]),
    ('docs/benchmarks.md', """values products {}x (forward and logit
gradient) and {}x (value gradient), logits {}x a pass at c4""", lambda: issue53_c4_kernels()[7:]),
    ('docs/benchmarks.md', '\n'.join(f'| {shape} | {dtype} | ' + _ISSUE53_ROW for shape in ('c4', 'c5, stride 2', 'c5')
                                      for dtype in ('bf16', 'fp32 (TF32)')), issue53_sm90),
]


def _spaced(text: str) -> str:
    """Runs of white space as one space: a passage may wrap anywhere."""
    return re.sub(r'\s+', ' ', text)


def _decimals(text: str) -> int:
    return len(text.partition('.')[2])


@pytest.mark.parametrize('page, passage, figures', FIGURES, ids=[f'{p}:{i}' for i, (p, _, _) in enumerate(FIGURES)])
def test_each_figure_equals_its_json(page, passage, figures):
    """The passage is on the page once, and each of its figures is the JSON's value rounded to its digits."""
    with open(os.path.join(ROOT, page)) as f:
        text = _spaced(f.read())
    pattern = NUMBER.join(re.escape(_spaced(part)) for part in passage.split('{}'))
    found = re.findall(pattern, text)
    assert len(found) == 1, f'{page}: the passage is there {len(found)} times, not once:\n{passage}'
    shown = found[0] if isinstance(found[0], tuple) else (found[0],)
    want = figures()
    assert len(shown) == len(want), (shown, want)
    wrong = [(s, round(w, _decimals(s) + 2)) for s, w in zip(shown, want)
             if abs(float(s) - w) > 0.5 * 10 ** -_decimals(s) + 1e-9]
    assert not wrong, f'{page}: figures that are not their JSON\'s (shown, JSON): {wrong}\nin:\n{passage}'


def test_an_edited_figure_fails():
    """The check itself: a figure one digit off in a copy of a passage is caught."""
    page, passage, figures = FIGURES[0]
    values = figures()
    right = passage.replace('{}', '{:.2f}').format(*values)
    wrong = right.replace(f'{values[0]:.2f}', f'{values[0] + 0.01:.2f}', 1)
    pattern = NUMBER.join(re.escape(part) for part in passage.split('{}'))
    assert [float(x) for x in re.findall(pattern, right)[0]] == [round(v, 2) for v in values]
    assert abs(float(re.findall(pattern, wrong)[0][0]) - values[0]) > 0.005


README_LINES, LINE_WIDTH = 200, 200


def test_readme_and_docs_sizes():
    """README.md at most 200 lines; no line of README.md or docs/*.md over 200 characters."""
    with open(os.path.join(ROOT, 'README.md')) as f:
        readme = f.read().splitlines()
    assert len(readme) <= README_LINES, f'README.md has {len(readme)} lines (at most {README_LINES})'
    pages = ['README.md'] + [os.path.join('docs', n) for n in sorted(os.listdir(os.path.join(ROOT, 'docs')))
                             if n.endswith('.md')]
    long = []
    for page in pages:
        with open(os.path.join(ROOT, page)) as f:
            long += [f'{page}:{i}: {len(line)}' for i, line in enumerate(f.read().splitlines(), 1)
                     if len(line) > LINE_WIDTH]
    assert not long, f'lines over {LINE_WIDTH} characters: {long}'


def _records(data):
    """The records of a result file that name their own provenance: the file, or each row of a list."""
    return data if isinstance(data, list) else [data]


@pytest.mark.parametrize('name', sorted(n for n in os.listdir(RESULTS) if n.startswith('gpu_') and n.endswith('.json')))
def test_gpu_results_name_their_commit_date_and_driver(name):
    """Every GPU result file names its command, date, commit (``+dirty`` or a note where the tree differed) and the
    GPU driver, in each record."""
    for record in _records(load(name)):
        assert record.get('command') and record.get('date'), f'{name}: no command or date'
        assert re.fullmatch(r'[0-9a-f]{7,40}(\+dirty)?( .*)?', str(record.get('commit', ''))), \
            f'{name}: commit {record.get("commit")!r}'
        machine = json.dumps(record.get('machine', ''))
        assert re.search(r'\d+\.\d+\.\d+', str(record.get('driver', ''))) or re.search(r'driver\W+\d+\.\d+', machine), \
            f'{name}: no GPU driver'
# appended to tests/test_doc_figures.py
