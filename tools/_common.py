"""Helpers shared by tools/train.py, tools/test.py and tools/quickstart.py."""
import os
import os.path as osp
import sys

REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


def ensure_repo_on_path():
    """Let ``custom_imports=['mmdet_plugin']`` resolve from a source checkout
    (also for worker processes, through PYTHONPATH) when the package is not
    installed."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    pp = os.environ.get('PYTHONPATH', '')
    if REPO_ROOT not in pp.split(os.pathsep):
        os.environ['PYTHONPATH'] = os.pathsep.join(
            [REPO_ROOT] + ([pp] if pp else []))


def add_runner_args(parser, cfg_options_help):
    """Arguments both Runner tools share (as in mmdet's tools/train.py and tools/test.py)."""
    parser.add_argument('--cfg-options', nargs='+', default=None, help=cfg_options_help)
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)


def parse_runner_args(parser, argv=None):
    """Parse, exporting LOCAL_RANK for mmengine when the launcher did not set it."""
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def load_config(args):
    """Config from ``args.config`` with ``--cfg-options``, launcher and work dir applied (as mmdet's tools)."""
    import argparse

    from mmengine.config import Config, DictAction

    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        ns = argparse.Namespace()
        DictAction(option_strings=['--cfg-options'], dest='o')(None, ns, args.cfg_options)
        cfg.merge_from_dict(ns.o)
    cfg.launcher = args.launcher
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir') is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])
    return cfg


def _ann_path(dataset):
    """Annotation file path of a (possibly wrapped) dataset config."""
    while 'dataset' in dataset and 'ann_file' not in dataset:
        dataset = dataset['dataset']
    ann = dataset.get('ann_file')
    if not ann:
        return None
    root = dataset.get('data_root') or ''
    if '://' in ann or osp.isabs(ann):
        return ann
    return osp.join(root, ann)


def check_annotation_files(cfg, splits=('train', 'val', 'test')):
    """Fail early, naming the config key, if an annotation file is missing
    (instead of a traceback from deep inside the dataloader build)."""
    for split in splits:
        loader = cfg.get(f'{split}_dataloader')
        if loader:
            path = _ann_path(loader['dataset'])
            if path and '://' not in path and not osp.isfile(path):
                raise FileNotFoundError(
                    f'{split}_dataloader.dataset.ann_file: annotation file '
                    f"'{path}' does not exist (data_root + ann_file); point "
                    f'it at your COCO json with --cfg-options '
                    f'{split}_dataloader.dataset.data_root=... '
                    f'{split}_dataloader.dataset.ann_file=...')
        evaluator = cfg.get(f'{split}_evaluator')
        if split != 'train' and isinstance(evaluator, dict):
            path = evaluator.get('ann_file')
            if path and '://' not in path and not osp.isfile(path):
                raise FileNotFoundError(
                    f"{split}_evaluator.ann_file: annotation file '{path}' "
                    'does not exist; set it with --cfg-options '
                    f'{split}_evaluator.ann_file=...')
