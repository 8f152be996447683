"""timm_lambda/paper.py (the one place each paper fact is written) against the paper's own text.

The paper's text is ../shared/papers/lambdanetworks_iclr.txt beside the repository (CI has it); the tables are
parsed from it here, independently of how paper.py writes them down. Without the papers these tests skip, saying
where they looked; where the papers are expected (CI=true, or TIMM_LAMBDA_REQUIRE_PAPERS=1) they fail instead.
"""
import os
import re
from pathlib import Path

import pytest

from timm_lambda import paper
from timm_lambda._env import env

PAPERS = Path(os.environ.get('TIMM_LAMBDA_PAPERS', Path(__file__).resolve().parents[2] / 'shared' / 'papers'))
PAPER = PAPERS / 'lambdanetworks_iclr.txt'
AA_PAPER = PAPERS / 'attention_augmented_convnets.txt'
REQUIRE_PAPERS = env('TIMM_LAMBDA_REQUIRE_PAPERS') or os.environ.get('CI', '').lower() == 'true'


@pytest.fixture(autouse=True)
def _papers_present():
    missing = [str(p) for p in (PAPER, AA_PAPER) if not p.is_file()]
    if missing and REQUIRE_PAPERS:
        pytest.fail(f'paper text not found: {", ".join(missing)} (CI=true or TIMM_LAMBDA_REQUIRE_PAPERS=1 requires '
                    'it; set TIMM_LAMBDA_PAPERS to the folder holding it)')
    if missing:
        pytest.skip(f'paper text not found: {", ".join(missing)} (set TIMM_LAMBDA_PAPERS)')


def _table_rows(caption: str, ncols: int):
    """Tab-separated rows of the table printed just above ``caption`` in the paper text."""
    lines = PAPER.read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith(caption))
    rows = []
    for line in reversed(lines[:end]):
        if not line.strip():
            if rows:
                break
            continue
        cells = line.split('\t')
        if len(cells) != ncols:
            break
        rows.append(cells)
    return rows[::-1]


def test_table20_hyperparameters():
    rows = _table_rows('Table 20:', 5)
    parsed = {(int(d), int(s)): (int(m), float(p), float(sd)) for d, s, m, p, sd in rows if d.isdigit()}
    assert parsed == paper.TABLE20


def test_table18_supervised_top1():
    rows = _table_rows('Table 18:', 5)
    parsed = {(int(d), int(s)): float(top1) for d, s, _, top1, _ in rows if d.isdigit() and top1 != '-'}
    assert parsed == paper.TABLE18_TOP1


def test_table19_blocks_and_lambda_positions():
    rows = _table_rows('Table 19:', 3)
    for name, blocks, positions in rows:
        if not name.startswith('LambdaResNet-'):
            continue
        depth = int(name.split('-')[1])
        assert tuple(int(b) for b in re.findall(r'\d+', blocks)) == paper.STAGE_DEPTHS[depth], name
        assert tuple(int(p) for p in re.findall(r'\d+', positions)) == paper.LAMBDA_BLOCKS[depth], name


def test_table14_results():
    rows = _table_rows('Table 14:', 5)
    parsed = []
    for row, box, box_sml, mask, mask_sml in rows[1:]:
        nums = lambda s: tuple(float(x) for x in re.findall(r'(\d+\.\d)(?:\s*\([+-]\d\.\d\))?', s))  # noqa: E731
        parsed.append((row, float(box.split()[0]), nums(box_sml), float(mask.split()[0]), nums(mask_sml)))
    assert parsed == [(row, box, sml, mask, msml) for row, _, box, sml, mask, msml in paper.TABLE14]


def test_parameter_counts():
    texts = {'LambdaNetworks': PAPER.read_text(), 'AA': AA_PAPER.read_text()}
    for name, (millions, where) in paper.PARAM_COUNTS.items():
        # every count we cite appears in the text of the paper it is cited from
        text = texts['AA' if where.startswith('AA') else 'LambdaNetworks']
        assert re.search(rf'(?<![\d.]){re.escape(f"{millions:g}")}(?![\d.])', text), (name, millions, where)


def test_flops():
    # Table 9: the content + position row; Table 17: the MobileNet-v2 with lambda blocks row (M)
    table9 = {(c.strip(), p.strip()): float(f) for c, p, _, f, _ in _table_rows('Table 9:', 5)[1:]}
    table17 = {row: float(f) / 1000 for row, _, f, _ in _table_rows('Table 17:', 4)[1:]}
    found = {'resnet50_lambda': (table9[('✓', '✓')], 'Table 9'),
             'mobilenetv2_100_lambda': (table17['MobileNet-v2 with 2 lightweight lambda blocks'], 'Table 17')}
    assert table17['MobileNet-v2'] == 0.603  # the baseline: twice Sandler et al.'s 300 M multiply-adds
    # AA Table 3 (space-separated): "AA-ResNet-50 (ours) 8.3 25.8M 77.7 93.8", the GFlops column first
    aa = AA_PAPER.read_text()
    aa_table3 = aa[:aa.index('Table 3:')].rsplit('Architecture GFlops Params', 1)[1]
    for depth in (34, 50, 101, 152):
        found[f'aa_resnet{depth}'] = (float(re.search(rf'^AA-ResNet-{depth} \(ours\) ([\d.]+) ', aa_table3, re.M)[1]),
                                      'AA Table 3')
    assert found == paper.FLOPS


def test_table4():
    rows = _table_rows('Table 4:', 5)[1:]
    assert len(rows) == len(paper.TABLE4)
    value = lambda cell: None if cell.strip() in ('-', 'OOM') else float(re.match(r'[\d.]+', cell.strip()).group())  # noqa: E731
    for (layer, _, memory, throughput, top1), cells in zip(paper.TABLE4, rows):
        assert layer.split(' (')[0] == cells[0].split(' (')[0], (layer, cells[0])
        assert (value(cells[2]), value(cells[3]), value(cells[4])) == (memory, throughput, top1), layer
