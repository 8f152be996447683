"""Every program that writes result JSON names the commit it ran at through one helper, ``harness.measure.commit``
(benchmarks/harness/measure.py; ``+dirty`` where tracked code differs from it), never a ``git rev-parse`` of its own
that would name a commit for an uncommitted tree (docs/results/launches.json once did)."""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# writers of JSON that is not a result: gpu_bundle.py's MANIFEST records the sources it bundled
NOT_RESULTS = {'tools/gpu_bundle.py'}
# the helper, imported by the lab (benchmarks/) or through tools/_lib/provenance.py, which reads the same file
HELPER = r'from (harness\.measure|_lib\.provenance) import (\([^)]*\bcommit\b|[^\n(]*\bcommit\b)'


def _writers():
    out = []
    for folder in ('tools', 'benchmarks'):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            rel = f'{folder}/{name}'
            if name.endswith('.py') and rel not in NOT_RESULTS:
                with open(os.path.join(ROOT, rel)) as f:
                    text = f.read()
                if 'json.dump' in text:
                    out.append((rel, text))
    return out


@pytest.mark.parametrize('name, text', _writers(), ids=[n for n, _ in _writers()])
def test_each_result_writer_names_its_commit_by_the_shared_helper(name, text):
    assert re.search(HELPER, text), f'{name} writes JSON without harness.measure.commit'
    assert 'commit()' in text, f'{name} imports commit but does not record it'
    assert 'rev-parse' not in text, f'{name} asks git for its commit itself (no +dirty)'


def test_the_helper_marks_an_uncommitted_tree_dirty(tmp_path, monkeypatch):
    """In a checkout whose tracked files differ from HEAD the commit ends in ``+dirty``; clean, it does not."""
    from harness import measure
    monkeypatch.delenv('TIMM_LAMBDA_COMMIT', raising=False)
    repo = tmp_path / 'repo'
    (repo / 'benchmarks' / 'harness').mkdir(parents=True)
    with open(measure.__file__) as f:
        (repo / 'benchmarks' / 'harness' / 'measure.py').write_text(f.read())
    env = dict(os.environ, GIT_AUTHOR_NAME='t', GIT_AUTHOR_EMAIL='t@t', GIT_COMMITTER_NAME='t',
               GIT_COMMITTER_EMAIL='t@t')
    for cmd in (['git', 'init', '-q'], ['git', 'add', '.'], ['git', 'commit', '-q', '-m', 'x']):
        subprocess.run(cmd, cwd=repo, check=True, env=env)
    head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=repo, capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(measure, '__file__', str(repo / 'benchmarks' / 'harness' / 'measure.py'))
    assert measure.commit() == head
    (repo / 'benchmarks' / 'harness' / 'measure.py').write_text('# changed\n')
    assert measure.commit() == head + '+dirty'


def test_the_tools_name_their_commit_by_the_same_helper():
    """tools/_lib/provenance.py's helpers are benchmarks/harness/measure.py's own functions, not copies."""
    from _lib import provenance
    from harness import measure
    for name in ('commit', 'cpu_model', 'load_average', 'machine'):
        assert getattr(provenance, name).__code__.co_filename == getattr(measure, name).__code__.co_filename, name


def test_dirty_names_differing_code_not_a_results_file(tmp_path):
    """A run of several parts writes its results file under docs/ after each part: that leaves the commit clean;
    any other tracked file that differs makes it ``+dirty``."""
    from harness.measure import commit

    def git(*args):
        subprocess.run(['git', *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / 'docs').mkdir()
    (tmp_path / 'docs' / 'result.json').write_text('{}')
    (tmp_path / 'README.md').write_text('a')
    (tmp_path / 'code.py').write_text('a = 1')
    git('init', '-q')
    git('add', '.')
    git('-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-q', '-m', 'c')
    head = commit(str(tmp_path))
    assert re.fullmatch('[0-9a-f]{40}', head), head
    (tmp_path / 'docs' / 'result.json').write_text('{"a": 1}')
    (tmp_path / 'README.md').write_text('b')
    assert commit(str(tmp_path)) == head
    (tmp_path / 'code.py').write_text('a = 2')
    assert commit(str(tmp_path)) == head + '+dirty'
