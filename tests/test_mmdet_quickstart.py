"""The README's main job, tools/quickstart.py, end to end (shortened)."""
import os.path as osp
import sys

from _mmdet_helpers import REPO, run


def test_quickstart_trains_saves_and_prints_coco_tables(tmp_path):
    work = str(tmp_path / 'qs')
    rc, out = run([sys.executable, osp.join(REPO, 'tools', 'quickstart.py'),
                   '--work-dir', work, '--iters', '2', '--num-train', '4',
                   '--num-val', '1', '--image-size', '64'], timeout=500)
    assert rc == 0, out[-4000:]
    assert osp.isfile(osp.join(work, 'iter_2.pth'))
    assert osp.isfile(osp.join(work, 'data', 'annotations',
                               'instances_val.json'))
    # pycocotools' summary, once for bbox and once for segm
    assert out.count('Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all'
                     ' | maxDets=100 ]') == 2, out[-3000:]
    assert 'Evaluating bbox' in out and 'Evaluating segm' in out
    assert '  bbox mAP=' in out and '  segm mAP=' in out
    assert 'Load checkpoint from' in out  # evaluated from the saved file
    assert '[quickstart] done in' in out
