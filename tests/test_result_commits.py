"""Every tool that writes result JSON names the commit it ran at through one helper, ``dev.benchmarks.measure.commit``
(``+dirty`` where tracked files differ from it), never a ``git rev-parse`` of its own that would name a commit for
an uncommitted tree (docs/results/launches.json once did)."""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, 'tools')
# writers of result JSON, not of a result: gpu_bundle.py's MANIFEST records the sources it bundled
NOT_RESULTS = {'gpu_bundle.py'}


def _writers():
    out = []
    for name in sorted(os.listdir(TOOLS)):
        if name.endswith('.py') and name not in NOT_RESULTS:
            with open(os.path.join(TOOLS, name)) as f:
                text = f.read()
            if 'json.dump' in text:
                out.append((name, text))
    return out


@pytest.mark.parametrize('name, text', _writers(), ids=[n for n, _ in _writers()])
def test_each_result_writer_names_its_commit_by_the_shared_helper(name, text):
    assert re.search(r'from dev\.benchmarks\.measure import (\([^)]*\bcommit\b|[^\n(]*\bcommit\b)', text), \
        f'tools/{name} writes JSON without dev.benchmarks.measure.commit'
    assert 'commit()' in text, f'tools/{name} imports commit but does not record it'
    assert 'rev-parse' not in text, f'tools/{name} asks git for its commit itself (no +dirty)'


def test_the_helper_marks_an_uncommitted_tree_dirty(tmp_path, monkeypatch):
    """In a checkout whose tracked files differ from HEAD the commit ends in ``+dirty``; clean, it does not."""
    import sys
    sys.path.insert(0, TOOLS)
    try:
        from dev.benchmarks import measure
    finally:
        sys.path.remove(TOOLS)
    monkeypatch.delenv('TIMM_LAMBDA_COMMIT', raising=False)
    repo = tmp_path / 'repo'
    (repo / 'tools' / 'dev' / 'benchmarks').mkdir(parents=True)
    with open(measure.__file__) as f:
        (repo / 'tools' / 'dev' / 'benchmarks' / 'measure.py').write_text(f.read())
    env = dict(os.environ, GIT_AUTHOR_NAME='t', GIT_AUTHOR_EMAIL='t@t', GIT_COMMITTER_NAME='t',
               GIT_COMMITTER_EMAIL='t@t')
    for cmd in (['git', 'init', '-q'], ['git', 'add', '.'], ['git', 'commit', '-q', '-m', 'x']):
        subprocess.run(cmd, cwd=repo, check=True, env=env)
    head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=repo, capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(measure, '__file__', str(repo / 'tools' / 'dev' / 'benchmarks' / 'measure.py'))
    assert measure.commit() == head
    (repo / 'tools' / 'dev' / 'benchmarks' / 'measure.py').write_text('# changed\n')
    assert measure.commit() == head + '+dirty'
