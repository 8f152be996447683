"""The README's main job, tools/quickstart.py: the default run, end to end, learns; its options reach the run.

The run here is the README's command with one option, ``--image-size 96`` (the default is 128): every step, file and
message of the default run, at about three quarters of its CPU time (bbox AP50 0.730 on the held-out images,
149 s on one core, 2026-11-24)."""
import _det  # noqa: F401  (skips this module without the [det] extra)

# isort: split
import os.path as osp
import re
import sys

import pytest

from _helpers import load_file
from _mmdet_helpers import REPO, run

pytestmark = pytest.mark.slow


def test_quickstart_default_run(tmp_path):
    """``python tools/quickstart.py --work-dir WORK --image-size 96``, the README's command at 96 px (one test: one
    run, about 2.5 minutes on one core, serves every check). It writes the data, the checkpoint, a COCO evaluation of
    the checkpoint loaded from disk, progress with ETA and both PNGs; on the held-out generated images it reaches
    bbox AP50 >= 0.3."""
    from _lib.quickstart import DEFAULTS
    work = str(tmp_path / 'qs')
    rc, out = run([sys.executable, osp.join(REPO, 'tools', 'quickstart.py'), '--work-dir', work, '--image-size', '96'],
                  timeout=1500)
    assert rc == 0, out[-4000:]
    assert osp.isfile(osp.join(work, f"iter_{DEFAULTS['iters']}.pth"))
    assert osp.isfile(osp.join(work, 'data', 'annotations', 'instances_val.json'))
    assert f"generated {DEFAULTS['num_train']} training and {DEFAULTS['num_val']} held-out images" in out
    # pycocotools' summary, once for bbox and once for segm, from the checkpoint loaded from disk
    assert out.count('Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all | maxDets=100 ]') == 2, out[-3000:]
    assert '  bbox mAP=' in out and '  segm mAP=' in out
    assert 'Load checkpoint from' in out
    assert 'eta:' in out  # per-iteration progress with ETA
    for png in ('predictions.png', 'loss.png'):
        assert osp.getsize(osp.join(work, png)) > 1000
        assert f'{osp.join(work, png)}' in out  # the path is printed
    assert '[quickstart] done in' in out
    ap50 = float(re.search(r'bbox mAP=[\d.-]+\s+mAP_50=([\d.-]+)', out).group(1))
    assert ap50 >= 0.3, out[-3000:]


def test_quickstart_options_reach_the_run(monkeypatch):
    """Every command-line option of tools/quickstart.py is handed to _lib.quickstart.run (the runs
    themselves are the run above and the mmdet end-to-end tests)."""
    tool = load_file('tools/quickstart.py', 'quickstart_tool')
    calls = []
    monkeypatch.setattr(tool, 'run', lambda config, work_dir, **kw: calls.append((config, work_dir, kw)))
    tool.main(['--work-dir', 'w', '--config', 'c.py', '--model', 'lambdaresnet26', '--iters', '2', '--image-size',
               '64', '--batch-size', '3', '--num-train', '4', '--num-val', '2', '--seed', '5', '--warmup-iters', '1',
               '--head-channels', '32', '--mask-convs', '1', '--lr', '0.5'])
    assert calls == [('c.py', 'w', dict(model='lambdaresnet26', iters=2, image_size=64, batch_size=3, num_train=4,
                                        num_val=2, seed=5, warmup_iters=1, head_channels=32, mask_convs=1, lr=0.5))]
