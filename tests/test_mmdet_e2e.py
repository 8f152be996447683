"""End to end: generated COCO data -> mmdet's own tools/train.py (resume) -> tools/test.py with COCO metrics;
torchrun with 2 CPU processes (gloo, the opt-in CPU config); weights_only loading of Runner checkpoints;
checkpoints, outputs and datasets that are wrong fail early, naming the problem."""
import _det  # noqa: F401  (skips this module without the [det] extra)

# isort: split
import glob
import io
import json
import os.path as osp
import pickle
import socket
import sys

import numpy as np
import pytest
import torch
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

import timm_lambda_mmdet.runner_checkpoints  # noqa: F401  (opts in to the allow-list, as the configs do)
from _lib.synthetic_coco import make_coco_dataset
from _mmdet_helpers import CLASSES, CONFIG_DIR, MMDET_TOOLS, python_m, run
from timm_lambda_mmdet.overrides import small_run_overrides, to_cli_options

pytestmark = pytest.mark.slow

CONFIG = osp.join(CONFIG_DIR,
                  'mask-rcnn_lambdaresnet101_fpn_syncbn_lsj-130k_coco.py')
METRIC_KEYS = [f'coco/{t}_{k}' for t in ('bbox', 'segm')
               for k in ('mAP', 'mAP_50', 'mAP_75', 'mAP_s', 'mAP_m',
                         'mAP_l')]


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('coco'))
    make_coco_dataset(root, num_train=8, num_val=2, image_size=96, seed=3)
    return root


def options(root, **kw):
    kw.setdefault('image_size', 64)
    kw.setdefault('classes', CLASSES)
    kw.setdefault('num_classes', len(CLASSES))
    kw.setdefault('validate', False)
    return to_cli_options(small_run_overrides(root, **kw))


def test_generator_valid_and_deterministic(tmp_path):
    a = make_coco_dataset(str(tmp_path / 'a'), num_train=10, num_val=3,
                              image_size=120, seed=7)
    b = make_coco_dataset(str(tmp_path / 'b'), num_train=10, num_val=3,
                              image_size=120, seed=7)
    c = make_coco_dataset(str(tmp_path / 'c'), num_train=10, num_val=3,
                              image_size=120, seed=8)
    for split in ('train', 'val'):
        with open(a[split], 'rb') as f1, open(b[split], 'rb') as f2:
            assert f1.read() == f2.read()
    with open(a['train'], 'rb') as f1, open(c['train'], 'rb') as f3:
        assert f1.read() != f3.read()
    coco = COCO(a['train'])
    assert [c['name'] for c in coco.loadCats(coco.getCatIds())] == list(
        CLASSES)
    anns = coco.loadAnns(coco.getAnnIds())
    crowd = [x for x in anns if x['iscrowd']]
    assert crowd and all(isinstance(x['segmentation'], dict) for x in crowd)
    polys = [x for x in anns if not x['iscrowd']]
    assert polys and all(isinstance(x['segmentation'], list) for x in polys)
    empty = [i for i in coco.getImgIds() if not coco.getAnnIds(imgIds=i)]
    assert empty, 'expected images without objects'
    assert any(im['width'] % 32 or im['height'] % 32
               for im in coco.loadImgs(coco.getImgIds()))
    for x in anns:
        img = coco.loadImgs(x['image_id'])[0]
        m = coco.annToMask(x)
        assert m.shape == (img['height'], img['width'])
        assert m.sum() > 0
        x0, y0, w, h = x['bbox']
        assert 0 <= x0 and 0 <= y0 and x0 + w <= img['width'] + 1e-6
        assert abs(m.sum() - x['area']) <= 0.25 * x['area'] + 20
        if x['iscrowd']:  # the RLE decodes to exactly its area
            rle = mask_utils.frPyObjects(x['segmentation'], img['height'],
                                         img['width'])
            assert int(mask_utils.area(rle)) == x['area']
        assert osp.isfile(osp.join(osp.dirname(osp.dirname(a['train'])),
                                   'train', img['file_name']))
    # pycocotools accepts the ground truth as detections (AP = 1)
    from pycocotools.cocoeval import COCOeval
    dets = coco.loadRes([dict(x, score=1.0) for x in polys])
    ev = COCOeval(coco, dets, 'segm')
    ev.evaluate(), ev.accumulate(), ev.summarize()
    assert ev.stats[0] > 0.99


def _metrics_from_json(work_dir):
    """The scalar json mmengine writes for a test run."""
    files = sorted(glob.glob(osp.join(work_dir, '*', '*.json')))
    for path in files:
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if 'coco/bbox_mAP' in rec:
                    return rec
    raise AssertionError(f'no COCO metrics in {files}')


def test_mmdet_train_resume_test(dataset, tmp_path):
    work = str(tmp_path / 'work')
    train = osp.join(MMDET_TOOLS, 'train.py')
    rc, out = run([sys.executable, train, CONFIG, '--work-dir', work,
                   '--cfg-options'] + options(dataset, max_iters=2))
    assert rc == 0, out[-4000:]
    assert osp.isfile(osp.join(work, 'iter_2.pth')), out[-2000:]
    # the checkpoint loads with torch's safe (weights_only) unpickler
    ckpt = torch.load(osp.join(work, 'iter_2.pth'), weights_only=True,
                      map_location='cpu')
    assert ckpt['meta']['iter'] == 2 and 'message_hub' in ckpt

    rc, out = run([sys.executable, train, CONFIG, '--work-dir', work,
                   '--resume', '--cfg-options'] +
                  options(dataset, max_iters=3))
    assert rc == 0, out[-4000:]
    assert 'resumed' in out.lower() or 'Load checkpoint' in out, out[-3000:]
    assert 'Iter(train) [3/3]' in out, out[-3000:]
    assert 'Iter(train) [1/3]' not in out, 'did not resume'
    assert osp.isfile(osp.join(work, 'iter_3.pth'))

    test = osp.join(MMDET_TOOLS, 'test.py')
    test_dir = str(tmp_path / 'test')
    rc, out = run([sys.executable, test, CONFIG,
                   osp.join(work, 'iter_3.pth'), '--work-dir', test_dir,
                   '--cfg-options'] + options(dataset))
    assert rc == 0, out[-4000:]
    assert 'Average Precision  (AP) @[ IoU=0.50:0.95' in out  # pycocotools
    rec = _metrics_from_json(test_dir)
    for k in METRIC_KEYS:
        assert k in rec and isinstance(rec[k], float), (k, rec)


def test_torchrun_two_cpu_processes_gloo(dataset, tmp_path):
    """The opt-in CPU variant of a Table 14 config, under torchrun."""
    config = CONFIG.replace('_coco.py', '_coco_cpu-ddp.py')
    work = str(tmp_path / 'dist')
    with socket.socket() as s:  # a free port: other runs of this test (pytest-xdist workers) use theirs
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', '2', '--master-port', str(port),
           osp.join(MMDET_TOOLS, 'train.py'), str(config), '--launcher', 'pytorch',
           '--work-dir', work, '--cfg-options'] + options(dataset, max_iters=1)
    rc, out = run(cmd, timeout=500)
    assert rc == 0, out[-5000:]
    assert 'Distributed launcher: pytorch' in out
    assert 'Distributed training: True' in out
    assert 'GPU number: 2' in out  # mmengine's wording for the world size
    assert 'reverting SyncBN' in out  # CPUCompatibleDDP on CPU
    assert 'Iter(train) [1/1]' in out
    assert osp.isfile(osp.join(work, 'iter_1.pth'))


@pytest.fixture(scope='module')
def python_m_checkpoint(dataset, tmp_path_factory):
    """``python -m timm_lambda_mmdet train``: one iteration; its checkpoint serves the tests below."""
    work = str(tmp_path_factory.mktemp('python_m') / 'work')
    rc, out = run(python_m('timm_lambda_mmdet', 'train', CONFIG, '--work-dir', work, '--cfg-options')
                  + options(dataset, max_iters=1))
    assert rc == 0, out[-4000:]
    assert osp.isfile(osp.join(work, 'iter_1.pth')), out[-2000:]
    return osp.join(work, 'iter_1.pth')


@pytest.mark.xdist_group('mmdet_python_m')
def test_python_m_runs_mmdets_own_scripts(dataset, python_m_checkpoint, tmp_path):
    """``python -m timm_lambda_mmdet train|test`` runs the tools/train.py and tools/test.py shipped in mmdet."""
    test_dir = str(tmp_path / 'test')
    rc, out = run(python_m('timm_lambda_mmdet', 'test', CONFIG, python_m_checkpoint, '--work-dir',
                           test_dir, '--out', str(tmp_path / 'preds.pkl'), '--cfg-options') + options(dataset))
    assert rc == 0, out[-4000:]
    rec = _metrics_from_json(test_dir)
    for k in METRIC_KEYS:
        assert k in rec, (k, rec)
    assert osp.isfile(tmp_path / 'preds.pkl')


def test_missing_files_name_the_parameter(dataset, tmp_path):
    opts = small_run_overrides(dataset, image_size=64, classes=CLASSES, num_classes=4,
                               train_ann='annotations/nope.json')
    rc, out = run(python_m('timm_lambda_mmdet', 'train', CONFIG, '--work-dir', str(tmp_path / 'w'),
                           '--cfg-options') + to_cli_options(opts), timeout=200)
    assert rc != 0
    assert 'ann_file' in out and 'nope.json' in out and 'does not exist' in out
    rc, out = run(python_m('timm_lambda_mmdet', 'test', CONFIG, str(tmp_path / 'absent.pth')), timeout=200)
    assert rc != 0 and 'absent.pth' in out


def test_test_refuses_a_checkpoint_of_another_model(dataset, tmp_path):
    """A timm ImageNet state dict (every detector key missing) is refused, naming the keys, instead of being
    scored with untrained heads."""
    import timm
    path = str(tmp_path / 'imagenet.pth')
    torch.save(timm.create_model('lambdaresnet50').state_dict(), path)
    rc, out = run(python_m('timm_lambda_mmdet', 'test', CONFIG, path, '--work-dir', str(tmp_path / 't'),
                           '--cfg-options') + options(dataset), timeout=300)
    assert rc != 0
    assert 'the checkpoint does not match the model' in out and 'missing keys' in out
    assert "'backbone.body" in out  # names keys
    assert 'Average Precision' not in out  # nothing was evaluated


@pytest.mark.xdist_group('mmdet_python_m')
def test_unwritable_out_fails_before_evaluating(dataset, python_m_checkpoint, tmp_path):
    rc, out = run(python_m('timm_lambda_mmdet', 'test', CONFIG, python_m_checkpoint, '--work-dir',
                           str(tmp_path / 't'), '--out', str(tmp_path / 'no' / 'such' / 'dir' / 'p.pkl'),
                           '--cfg-options') + options(dataset), timeout=300)
    assert rc != 0
    assert 'does not exist' in out and 'out_file_path' in out
    assert 'Average Precision' not in out


def test_weights_only_allow_list_is_narrow():
    """Only HistoryBuffer statistics methods may be fetched by getattr."""
    from mmengine.logging import HistoryBuffer

    class Sneaky:
        def __reduce__(self):
            return (getattr, (HistoryBuffer, '__init__'))

    buf = io.BytesIO()
    pickle.dump({'x': Sneaky()}, buf, protocol=2)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(buf, weights_only=True)
    hb = HistoryBuffer([1.0, 2.0], [1, 1])
    buf = io.BytesIO()
    torch.save({'hb': hb, 'a': np.arange(3), 's': np.float64(2.5)}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert back['hb'].mean() == 1.5 and back['s'] == 2.5


@pytest.fixture(scope='module')
def timm_train_checkpoint(tmp_path_factory):
    """A lambdaresnet50 checkpoint written by timm's CheckpointSaver as train.py does (``state_dict``,
    ``state_dict_ema``, ``args``, ``optimizer``, ...), its EMA weights differing from the raw ones."""
    import argparse

    import timm
    from timm.utils import CheckpointSaver, ModelEmaV3
    torch.manual_seed(0)
    model = timm.create_model('lambdaresnet50', num_classes=4)
    ema = ModelEmaV3(model, decay=0.9999)
    with torch.no_grad():
        for v in ema.module.state_dict().values():
            if v.is_floating_point():
                v.add_(1)
    out = str(tmp_path_factory.mktemp('timm_ckpt'))
    saver = CheckpointSaver(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                            args=argparse.Namespace(model='lambdaresnet50'), model_ema=ema, checkpoint_dir=out,
                            recovery_dir=out)
    saver.save_checkpoint(epoch=0, metric=1.0)
    path = osp.join(out, 'checkpoint-0.pth.tar')
    ckpt = torch.load(path, map_location='cpu', weights_only=False)
    assert {'state_dict', 'state_dict_ema', 'args', 'optimizer'} <= set(ckpt)
    return path, ckpt['state_dict'], ckpt['state_dict_ema']


def _assert_backbone_is(detector_state, expected, other):
    """Every non-classifier tensor of the timm checkpoint sits in the detector's backbone (timm's features_only
    model flattens ``stages.0`` to ``stages_0``), equal to ``expected`` and not to ``other``."""
    n = 0
    for k, v in expected.items():
        if k.startswith('fc.'):
            continue
        parts = k.split('.')
        key = next(c for c in ('backbone.body.' + k, 'backbone.body.' + '_'.join(parts[:2]) + '.' + '.'.join(parts[2:]))
                   if c in detector_state)
        assert torch.equal(detector_state[key], v), key
        if v.is_floating_point():
            assert not torch.equal(detector_state[key], other[k]), key
        n += 1
    assert n > 300


@pytest.mark.parametrize('route', ['child_config', 'cfg_options'])
def test_pretrained_backbone_route_of_the_readme(dataset, timm_train_checkpoint, tmp_path, route):
    """The README's route for a timm ImageNet checkpoint, end to end through mmdet's train.py: a child config
    ``model = dict(backbone=dict(init_cfg=dict(type='Pretrained', checkpoint=PATH)))`` or ``--cfg-options
    model.backbone.init_cfg.type=Pretrained model.backbone.init_cfg.checkpoint=PATH`` loads the EMA weights
    (timm's load_checkpoint default). The backbone is frozen so that the saved weights are the loaded ones."""
    path, raw, ema = timm_train_checkpoint
    extra = ['model.backbone.model_name=lambdaresnet50', 'model.backbone.frozen_stages=4']
    config = CONFIG
    if route == 'child_config':
        config = str(tmp_path / 'child.py')
        with open(config, 'w') as f:
            f.write(f'_base_ = {CONFIG!r}\n'
                    f"model = dict(backbone=dict(init_cfg=dict(type='Pretrained', checkpoint={path!r})))\n")
    else:
        extra += ['model.backbone.init_cfg.type=Pretrained', f'model.backbone.init_cfg.checkpoint={path}']
    work = str(tmp_path / 'work')
    rc, out = run([sys.executable, osp.join(MMDET_TOOLS, 'train.py'), config, '--work-dir', work, '--cfg-options']
                  + options(dataset, max_iters=1) + extra)
    assert rc == 0, out[-4000:]
    assert f'Loaded 408 tensors of lambdaresnet50 from {path} (EMA weights where present)' in out, out[-3000:]
    state = torch.load(osp.join(work, 'iter_1.pth'), map_location='cpu', weights_only=True)['state_dict']
    _assert_backbone_is(state, ema, raw)


def test_empty_checkpoint_names_the_file(dataset, tmp_path):
    """An empty checkpoint (an interrupted save or copy) for tools/test.py and for --resume: an error naming the
    file and the setting before the run, instead of torch's bare EOFError."""
    empty = tmp_path / 'empty.pth'
    empty.write_bytes(b'')
    rc, out = run(python_m('timm_lambda_mmdet', 'test', CONFIG, str(empty), '--work-dir', str(tmp_path / 't'),
                           '--cfg-options') + options(dataset), timeout=300)
    assert rc != 0
    assert f"load_from (the config's, or tools/test.py CHECKPOINT): checkpoint file '{empty}' is empty" in out, \
        out[-3000:]
    work = tmp_path / 'work'
    work.mkdir()
    (work / 'iter_2.pth').write_bytes(b'')
    (work / 'last_checkpoint').write_text(str(work / 'iter_2.pth'))  # as mmengine's CheckpointHook writes it
    rc, out = run(python_m('timm_lambda_mmdet', 'train', CONFIG, '--work-dir', str(work), '--resume',
                           '--cfg-options') + options(dataset, max_iters=3), timeout=300)
    assert rc != 0
    assert f"checkpoint file '{work / 'iter_2.pth'}' is empty" in out and 'resume' in out, out[-3000:]
    assert 'Iter(train)' not in out


def test_timm_imagenet_lambda_backbone_config(dataset, tmp_path):
    """configs/mmdet/mask-rcnn_lambda-resnet50ts-fast-in1k_*: Mask R-CNN on lambda_resnet50ts_fast with timm's ImageNet
    checkpoint through init_cfg (a timm lambda_resnet50ts saved as timm's file is, standing in for its download),
    through mmdet's train.py; the backbone frozen, the detector's backbone holds timm's weights in our keys."""
    import timm

    from timm_lambda.models import checkpoint_filter_timm_lambda_layers
    torch.manual_seed(0)
    theirs = timm.create_model('lambda_resnet50ts').state_dict()
    fresh = timm.create_model('lambda_resnet50ts_fast').state_dict()
    with torch.no_grad():  # every tensor unlike a fresh model's (zero-initialised last norms of residual branches)
        for v in theirs.values():
            if v.is_floating_point():
                v.add_(torch.rand_like(v) * 0.1 + 0.01)
    path = str(tmp_path / 'lambda_resnet50ts_a1h_256.pth')
    torch.save(theirs, path)
    config = osp.join(CONFIG_DIR, 'mask-rcnn_lambda-resnet50ts-fast-in1k_fpn_syncbn-all_lsj-130k_coco.py')
    work = str(tmp_path / 'work')
    rc, out = run([sys.executable, osp.join(MMDET_TOOLS, 'train.py'), config, '--work-dir', work, '--cfg-options']
                  + options(dataset, max_iters=1)
                  + [f'model.backbone.init_cfg.checkpoint={path}', 'model.backbone.frozen_stages=4'])
    assert rc == 0, out[-4000:]
    assert f'Loaded 390 tensors of lambda_resnet50ts_fast from {path}' in out, out[-3000:]
    state = torch.load(osp.join(work, 'iter_1.pth'), map_location='cpu', weights_only=True)['state_dict']
    mapped = checkpoint_filter_timm_lambda_layers(theirs)
    assert any(k.endswith('pos_embedding.weight') for k in mapped) and not any('conv_lambda' in k for k in mapped)
    _assert_backbone_is(state, {k.replace('head.fc.', 'fc.'): v for k, v in mapped.items()}, fresh)
