"""form='auto' rule (timm_lambda.layers.position_lambda.choose_form) against the committed sweeps.

The expectations are read from docs/results/sweep_*.json, written by the commands in their ``command`` field
(`benchmarks/benchmark_lambda_layer.py --sweep ...`): training steps of the dense and tiled forms side by side,
interleaved rounds, min / median / max per size. At every measured size where one form is clearly faster,
``'auto'`` must choose it. Clearly faster: its median round is faster than the other form's fastest round
(at least 3 of its 5 rounds beat all 5 of the other's). The margin comes from the data's spread: the rounds of
one form spread by 6-194% of its median (outlier rounds of the tiled form at 24 px, 23x23 scope: 13-50 ms), so a few
percent between medians does not say which form is faster. In the committed sweeps (2026-11-24, the tiled form's
CPU kernel) 20 sizes are decided, the slower median 1.04-32x the faster; 2 are not (6 and 7 px at 7x7).
"""
import json
from pathlib import Path

import pytest
import torch

from _helpers import load_file
from timm_lambda.layers import LambdaLayer

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = sorted((ROOT / 'docs' / 'results').glob('sweep_*.json'))
FORMS = ('dense', 'tiled')  # the forms 'auto' chooses between, as named in the sweep files and in `form`


def _load(path):
    return json.loads(path.read_text())


def clearly_faster(row):
    """The form whose median round beats the other form's fastest round, or None (within the spread)."""
    fast, slow = sorted(FORMS, key=lambda k: row[k]['ms'])
    return fast if row[fast]['ms'] < row[slow]['min_ms'] else None


def _clear_cases():
    """(settings, size, winner) for every measured size where one form is clearly faster; the others decide
    nothing and are left out."""
    for path in SWEEPS:
        sweep = _load(path)
        for row in sweep['results']:
            if all(k in row for k in FORMS) and clearly_faster(row):
                yield pytest.param(sweep['settings'], row['size'], clearly_faster(row),
                                   id=f"{path.stem}-{row['size']}px")


def test_the_sweeps_are_committed_and_decide_both_ways():
    """The test below must have something to check: both sweeps, each with sizes where each form clearly wins."""
    assert {p.name for p in SWEEPS} >= {'sweep_scope23.json', 'sweep_scope7_u4.json'}
    for path in SWEEPS:
        rows = [r for r in _load(path)['results'] if all(k in r for k in FORMS)]
        assert {clearly_faster(r) for r in rows} >= set(FORMS), path.name


@pytest.mark.parametrize('settings,side,winner', list(_clear_cases()))
def test_auto_chooses_the_form_measured_clearly_faster(settings, side, winner):
    layer = LambdaLayer(16, dim_k=4, heads=2, dim_u=settings['dim_u'], scope=settings['scope'])
    assert layer.choose_form(side, side) == winner


def test_global_scope_is_always_dense():
    layer = LambdaLayer(16, dim_k=4, heads=2, scope='global', max_size=(64, 64))
    assert layer.choose_form(64, 64) == 'dense'


def test_explicit_impl_is_kept():
    layer = LambdaLayer(16, dim_k=4, heads=2, form='conv')
    assert layer.choose_form(1, 1) == 'conv'


def test_auto_gives_the_same_output_as_every_impl():
    torch.manual_seed(0)
    layer = LambdaLayer(16, dim_k=4, heads=2, dim_u=4, scope=7).eval()
    for hw in [(9, 9), (12, 11)]:
        x = torch.randn(2, 16, *hw)
        layer.form = 'auto'
        auto = layer(x)
        for form in ('einsum', 'conv', 'dense', 'tiled'):
            layer.form = form
            torch.testing.assert_close(auto, layer(x), rtol=1e-4, atol=1e-4)


def test_the_documented_sweep_command_writes_the_committed_format(tmp_path):
    """A tiny sweep by the tool writes the same keys as the committed files (which the tests above read); a
    committed file may also hold ``memory``, the record of a later ``--memory-only`` run over it."""
    tool = load_file('benchmarks/benchmark_lambda_layer.py', 'benchmark_lambda_layer')
    out = tmp_path / 'sweep.json'
    tool.main(['--sweep', '--width', '8', '--scope', '7', '--sizes', '5', '--repeats', '1', '--json', str(out)])
    written, committed = _load(out), _load(ROOT / 'docs' / 'results' / 'sweep_scope7_u4.json')
    # the tool now also names the commit it ran at (the committed sweeps predate that)
    assert written['commit'] and [k for k in written if k != 'commit'] == [
        key for key in committed if key not in ('memory', 'commit')]
    assert list(written['settings']) == list(committed['settings'])
    assert written['command'].startswith('python benchmarks/benchmark_lambda_layer.py --sweep')
    row, committed_row = written['results'][0], committed['results'][0]
    assert list(row) == list(committed_row)
    assert all(list(row[k]) == list(committed_row[k]) for k in row if k != 'size')
