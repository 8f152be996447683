"""benchmarks/count_macs.py: the multiply-adds that the tensor-core kernels of the tiled position lambdas issue, from
their grids and tiles. Its formula must equal what the kernels do (every ``tl.dot`` and torch matrix product counted
while the wrappers run under Triton's interpreter on small maps, launch by launch), and the committed figures
(docs/results/kernel_macs.json) must be the formula's at today's tiles."""
import json
import os
import subprocess
import sys

from _helpers import require_triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, 'benchmarks', 'count_macs.py')
RESULT = os.path.join(ROOT, 'docs', 'results', 'kernel_macs.json')


def test_formula_equals_the_interpreted_kernels_count():
    """Stride 1 (the kernels compute their logits) and 2 (GEMMs do), bfloat16 and TF32 tiles, |u| 2, a small grid as
    on a GPU, one image a chunk, |v| over 128: every dot site's multiply-adds and every kernel's launches and programs
    equal. About 30 s on 2 shared cores."""
    require_triton()
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]))
    out = subprocess.run([sys.executable, TOOL, '--check'], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count('formula == interpreted') == 10, out.stdout


def test_committed_figures_are_the_formulas():
    """docs/results/kernel_macs.json holds what the formula gives at the wrappers' current tiles (a change to
    ``tc_launch_meta`` or the kernels' loops regenerates it: ``python benchmarks/count_macs.py --json
    docs/results/kernel_macs.json``), and each row's totals are its sites' sums against the query-side form."""
    sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
    import count_macs
    with open(RESULT) as f:
        committed = json.load(f)
    fresh = count_macs.table(committed['batch'], committed['sms'])
    assert len(committed['rows']) == len(fresh) == 6
    for old, new in zip(committed['rows'], fresh):
        key = (old['shape'], old['dtype'])
        assert (old['issued'], old['needed']) == (new['issued'], new['needed']), (
            f'{key}: docs/results/kernel_macs.json is stale; regenerate it: python benchmarks/count_macs.py --json '
            'docs/results/kernel_macs.json')
        assert old['issued']['train'] == sum(s['issued'] for s in old['sites'])
        assert old['needed']['train'] == 4 * old['needed']['logits'] + 3 * old['needed']['values']
