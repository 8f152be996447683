"""The README's main job, tools/quickstart.py: end to end (shortened), and the full default run learns."""
import _det  # noqa: F401  (skips this module without the [det] extra)
import os.path as osp
import re
import sys

import pytest

from _mmdet_helpers import REPO, run

pytestmark = pytest.mark.slow


def test_quickstart_pipeline_shortened(tmp_path):
    work = str(tmp_path / 'qs')
    rc, out = run([sys.executable, osp.join(REPO, 'tools', 'quickstart.py'), '--work-dir', work, '--iters', '2',
                   '--num-train', '4', '--num-val', '2', '--image-size', '64', '--batch-size', '2'], timeout=500)
    assert rc == 0, out[-4000:]
    assert osp.isfile(osp.join(work, 'iter_2.pth'))
    assert osp.isfile(osp.join(work, 'data', 'annotations', 'instances_val.json'))
    # pycocotools' summary, once for bbox and once for segm, from the checkpoint loaded from disk
    assert out.count('Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all | maxDets=100 ]') == 2, out[-3000:]
    assert '  bbox mAP=' in out and '  segm mAP=' in out
    assert 'Load checkpoint from' in out
    assert 'eta:' in out  # per-iteration progress with ETA
    for png in ('predictions.png', 'loss.png'):
        assert osp.getsize(osp.join(work, png)) > 1000
        assert f'{osp.join(work, png)}' in out  # the path is printed
    assert '[quickstart] done in' in out


def test_quickstart_default_run_detects(tmp_path):
    """The README's main job as it is: on held-out generated images it reaches bbox AP50 >= 0.3."""
    work = str(tmp_path / 'qs')
    rc, out = run([sys.executable, osp.join(REPO, 'tools', 'quickstart.py'), '--work-dir', work], timeout=1500)
    assert rc == 0, out[-4000:]
    ap50 = float(re.search(r'bbox mAP=[\d.-]+\s+mAP_50=([\d.-]+)', out).group(1))
    assert ap50 >= 0.3, out[-3000:]
