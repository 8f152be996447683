"""The documents' figures (issue 59): every performance figure of README.md and docs/*.md stands in a generated block,
rendered from a committed JSON by ``python tools/generate.py`` (tests/test_generated.py holds each block to its JSON
and its JSON to existing); the few figures that are not results are listed with the reason. Also: the pages' sizes,
the GPU results' provenance, and the measurement programs' list in docs/benchmarks.md."""
import json
import re
from pathlib import Path

import pytest

from _lib.docs import BLOCK

REPO = Path(__file__).resolve().parents[1]
PAGES = ['README.md'] + sorted(f'docs/{p.name}' for p in (REPO / 'docs').glob('*.md'))
RESULTS = REPO / 'docs' / 'results'

# A performance figure: a ratio written with x (0.47x, 1.2-2.1x), a time, a memory size, an AP.
NUMBER = r'(?<![\w.])\d+(?:\.\d+)?(?:\s?[-/]\s?\d+(?:\.\d+)?)*'
FIGURE = re.compile(rf'{NUMBER}x(?!\w)'
                    rf'|{NUMBER}\s?(?:ms|us|µs|s|sec|seconds?|min|minutes?|h|hours?)\b'
                    rf'|{NUMBER}\s?(?:[KMGT]i?B)\b'
                    rf'|\bAP\w*\b[^.|\n]{{0,30}}?\d\.\d+')
# (page, the text around the figure on its line, why it is no result of this project's code; None: the page's times
# and sizes)
EXCEPTIONS = [
    ('README.md', 'about 40 s, once', 'how long the kernel build takes: a wait to plan for, not a result'),
    ('README.md', 'about 17 minutes on 2 cores', "how long mmcv's build takes, likewise"),
    ('README.md', '+17 min once for mmcv', 'the same build, in the quick start command line'),
    ('docs/install.md', None, "build and download times and sizes, the GPU slot's limits: what an install plans for"),
    ('docs/execution_modes.md', '(512 MiB in float32', 'what a constant allows: 2^27 float32 logits'),
    ('docs/execution_modes.md', '256 MiB in float32', 'what a constant allows: 2^26 float32 logits'),
    ('docs/execution_modes.md', 'at most 64 MiB', "the caches' configured limits"),
    ('docs/execution_modes.md', '45x45: 32 MiB', "the caches' configured limits"),
    ('docs/execution_modes.md', 'at most 16 MiB', "the caches' configured limits"),
    ('docs/execution_modes.md', 'at most 8 MiB', "the caches' configured limits"),
    ('docs/lambda_layer.md', 'contraction (3-4x', 'arithmetic: |h| instead of |k| in the contraction'),
    ('docs/lambda_layer.md', 'has 4x fewer rows', 'arithmetic: the pooled queries'),
]


def _outside_blocks(text: str) -> str:
    """``text`` with every generated block's lines blank (line numbers kept)."""
    return BLOCK.sub(lambda m: '\n' * m.group(0).count('\n'), text)


def _excepted(page: str, line: str, figure: str) -> bool:
    """Listed: its text on its line, or its page excepted whole (times and sizes only, never a ratio or an AP)."""
    whole = not figure.endswith('x') and not figure.startswith('AP')
    return any(p == page and (around in line and figure in around if around else whole) for p, around, _ in EXCEPTIONS)


def figures_outside_blocks(page: str, text: str):
    """``(line number, figure, line)`` of each performance figure of ``text`` outside a generated block."""
    found = []
    for number, line in enumerate(_outside_blocks(text).splitlines(), 1):
        for m in FIGURE.finditer(line):
            if not _excepted(page, line, m.group(0)):
                found.append((number, m.group(0), line.strip()))
    return found


@pytest.mark.parametrize('page', PAGES)
def test_no_performance_figure_outside_a_generated_block(page):
    found = figures_outside_blocks(page, (REPO / page).read_text())
    assert not found, (f'{page}: performance figures outside a generated block (render them from their JSON by '
                       f'tools/_lib/results.py, or list the exception with its reason):\n'
                       + '\n'.join(f'  {page}:{n}: {fig!r} in: {line}' for n, fig, line in found))


def test_the_scanner_sees_each_kind_of_figure_and_spares_the_blocks():
    text = ('The layer is 0.47x the conv, 1.2-2.1x faster; a step takes 35 ms (2.5 s, 90 us); it holds 20 MiB; a '
            'held-out bbox AP50 of about 0.7.\n<!-- generated:t from docs/results/x.json -->\n0.5x 3 ms 4 GiB\n'
            '<!-- /generated:t -->\nA batch of 128 x 8 GPUs, 4 heads, Table 3, 12.5% chance.\n')
    found = [f for _, f, _ in figures_outside_blocks('README.md', text)]
    assert found == ['0.47x', '1.2-2.1x', '35 ms', '2.5 s', '90 us', '20 MiB', 'AP50 of about 0.7'], found
    assert figures_outside_blocks('README.md', 'mmcv builds in about 17 minutes on 2 cores.') == []
    assert figures_outside_blocks('README.md', 'mmcv builds in about 18 minutes on 2 cores.') != []


def test_every_exception_is_still_needed():
    """An exception whose text is gone from its page is removed from the list."""
    for page, around, why in EXCEPTIONS:
        if around is not None:
            assert around in (REPO / page).read_text(), f'{page} no longer says {around!r} ({why}): drop it'


@pytest.mark.parametrize('page', PAGES)
def test_each_result_block_names_committed_json(page):
    for m in BLOCK.finditer((REPO / page).read_text()):
        for name in (m.group('source') or '').split(', '):
            if name and '*' not in name:
                assert (REPO / name.split('#')[0]).is_file(), f'{page}: block {m.group("name")} names {name}'


def test_every_measurement_program_is_listed_with_its_command():
    page = (REPO / 'docs' / 'benchmarks.md').read_text()
    for program in sorted((REPO / 'benchmarks').glob('*.py')):
        assert f'`python benchmarks/{program.name}' in page, f'docs/benchmarks.md does not list {program.name}'


README_LINES, BENCHMARKS_LINES, LINE_WIDTH = 200, 400, 200


def test_readme_and_docs_sizes():
    """README.md at most 200 lines, docs/benchmarks.md at most 400; no line of README.md or docs/*.md over 200
    characters outside the generated blocks (a generated table is as wide as its columns)."""
    texts = {page: (REPO / page).read_text() for page in PAGES}
    assert len(texts['README.md'].splitlines()) <= README_LINES, len(texts['README.md'].splitlines())
    assert len(texts['docs/benchmarks.md'].splitlines()) <= BENCHMARKS_LINES
    long = [f'{page}:{i}: {len(line)}' for page in PAGES
            for i, line in enumerate(_outside_blocks(texts[page]).splitlines(), 1) if len(line) > LINE_WIDTH]
    assert not long, f'lines over {LINE_WIDTH} characters: {long}'


@pytest.mark.parametrize('name', sorted(p.name for p in RESULTS.glob('gpu_*.json')))
def test_gpu_results_name_their_commit_date_and_driver(name):
    """Every GPU result file names its command, date, commit (``+dirty`` or a note where the tree differed) and the
    GPU driver, in each record."""
    data = json.loads((RESULTS / name).read_text())
    for record in data if isinstance(data, list) else [data]:
        assert record.get('command') and record.get('date'), f'{name}: no command or date'
        assert re.fullmatch(r'[0-9a-f]{7,40}(\+dirty)?( .*)?', str(record.get('commit', ''))), \
            f'{name}: commit {record.get("commit")!r}'
        machine = json.dumps(record.get('machine', ''))
        assert re.search(r'\d+\.\d+\.\d+', str(record.get('driver', ''))) or re.search(r'driver\W+\d+\.\d+', machine), \
            f'{name}: no GPU driver'
