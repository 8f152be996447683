"""Training recipes generated from the paper facts in :mod:`timm_lambda.paper`, and their checks.

* timm ``train.py`` recipes (``configs/timm/*.yaml``): :func:`all_recipes`, from the templates in
  ``tools/_lib/recipe_templates/`` (``str.format`` fields in braces, filled from the paper facts);
* MMDetection configs of Table 14 (``configs/mmdet/*.py``): :func:`mmdet_configs`, and their
  ``configs/mmdet/metafile.yml`` in the format of mmdet's own configs (:func:`mmdet_metafile`);
* the argument names of timm's ``train.py`` (:func:`parse_train_py`, read with :mod:`ast`, nothing executed),
  against which the YAML keys are checked: ``train.py --config X.yaml`` calls ``parser.set_defaults(**yaml)``,
  so a key that is not one of its arguments would be silently ignored.

``python tools/generate.py`` writes the files; ``tests/test_generated.py`` checks the committed files equal
the generated ones, so a fact changes in one place.
"""
import ast
import sys
from importlib.resources import files
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from timm_lambda.paper import COCO_SETUP, RESOLUTIONS, TABLE3_TOP1, TABLE14, TABLE18_TOP1, TABLE20

__all__ = ['all_recipes', 'recipe_350', 'recipe_90', 'mmdet_configs', 'mmdet_config_name', 'mmdet_metafile',
           'parse_train_py',
           'read_args_file', 'write_args_file', 'check_configs', 'NOT_IN_YAML']


def _template(name: str) -> str:
    """The text of ``recipe_templates/<name>`` (package data): a ``str.format`` template, or a recipe as is."""
    return (files(__package__) / 'recipe_templates' / name).read_text(encoding='utf-8')


def recipe_350(depth: int, size: int) -> str:
    """The 350-epoch recipe of one Table 20 row (F.3), for ``lambdaresnet{depth}`` at ``size``."""
    ra, drop, drop_path = TABLE20[depth, size]
    top1 = TABLE18_TOP1.get((depth, size))
    if top1 is None:
        sentence = 'Table 18 has no supervised top-1 for this row (only pseudo-label training: 86.7%).'
    else:
        sentence = f'Table 18 reports {top1}% supervised ImageNet top-1 for this row.'
    model = f'lambdaresnet{depth}.r{size}'
    model_line = f'model: {model:<23}# pretrained-cfg tag r{size}: input {size}x{size}, bicubic'
    return _template('lambdaresnet_350ep.yaml').format(
        depth=depth, size=size, ra=ra, drop=drop, drop_path=drop_path, top1_sentence=sentence,
        filename=f'lambdaresnet{depth}_r{size}_350ep.yaml', model_line=model_line)


def recipe_90(model: str) -> str:
    """The 90-epoch vanilla-ResNet recipe (F.3) for a Table 3 lambda model."""
    title, row = {
        'resnet50_lambda': ('ResNet-50 with every 3x3 conv replaced by a lambda layer', 'Lambda layer'),
        'resnet50_lambda_u4': ('ResNet-50 with lambda layers, intra-depth |u|=4, scope 7x7', 'Lambda layer (|u|=4)'),
    }[model]
    return _template('resnet50_lambda_90ep.yaml').format(
        title=title, row=row, top1=TABLE3_TOP1[row], filename=f'{model}_90ep.yaml', model=f'{model}.r224')


def all_recipes() -> Dict[str, str]:
    """``{file name: YAML text}`` of every recipe in configs/timm/."""
    out = {f'lambdaresnet{d}_r{s}_350ep.yaml': recipe_350(d, s) for (d, s) in TABLE20 if s in RESOLUTIONS[d]}
    out.update({f'{m}_90ep.yaml': recipe_90(m) for m in ('resnet50_lambda', 'resnet50_lambda_u4')})
    # Table 17 / F.3 "Mobilenet training setup", and the seed CIFAR-10 reproduction report's setup
    # (paper.CIFAR10_REPORT) for resnet50_lambda_global32: one recipe each, used as written
    for name in ('mobilenetv2_100_lambda_350ep.yaml', 'resnet50_lambda_global32_cifar10_90ep.yaml'):
        out[name] = _template(name)
    return out


def mmdet_config_name(model: str) -> str:
    """File name (in configs/mmdet/) of the Table 14 config whose backbone is the timm model ``model``."""
    return f"mask-rcnn_{model.replace('_nose', '-nose')}_fpn_syncbn_lsj-130k_coco.py"


def mmdet_configs() -> Dict[str, str]:
    """``{file name: config text}`` of the Table 14 MMDetection configs (each also in a mixed-precision variant)."""
    out = {}
    for row, model, *_ in TABLE14:
        depth = ''.join(c for c in model if c.isdigit())
        if model.startswith('lambda'):
            backbone = row
        elif model.endswith('_nose'):
            backbone = f'{row} (ResNet-RS-{depth} without squeeze-excitation)'
        else:
            backbone = f'{row} (timm ResNet-RS-{depth})'
        name = mmdet_config_name(model)
        out[name] = (f'# Table 14 row "{row}": Mask R-CNN FPN, {backbone} backbone,\n'
                     '# trained from scratch at 1024x1024 (LambdaNetworks appendix F.3).\n'
                     "_base_ = './_base_/mask-rcnn_timm-fpn_syncbn_lsj-130k_coco.py'\n\n"
                     f"model = dict(backbone=dict(model_name='{model}'))\n")
        amp = name.replace('_lsj-', '_amp-lsj-')
        out[amp] = ('# Mixed-precision (AmpOptimWrapper, dynamic loss scale) variant of\n'
                    f'# {name}; needs a GPU.\n'
                    f"_base_ = './{name}'\n\n"
                    "optim_wrapper = dict(type='AmpOptimWrapper')\n")
    return out


def mmdet_metafile() -> str:
    """configs/mmdet/metafile.yml: the Table 14 configs in the format of mmdet's own ``configs/*/metafile.yml``
    (Collections, Models with Name, Config, Metadata, Results, Paper, README). The Results are the paper's
    (Table 14), labelled as such, and no model has Weights: no checkpoint trained with these configs is published."""
    setup = COCO_SETUP
    lines = [
        '# Generated by tools/generate.py from timm_lambda/paper.py: the Table 14 configs in the format of',
        "# MMDetection's configs/*/metafile.yml. Every Results entry is the LambdaNetworks paper's (Table 14, 128",
        '# TPUv3 cores), not produced by these configs, and no entry has Weights (in mmdet a link to a published',
        '# checkpoint of the config; there is none). The _amp- and _cpu-ddp variants train the same models.',
        'Collections:',
        '  - Name: LambdaNetworks',
        '    Metadata:',
        '      Training Data: COCO',
        '      Training Techniques:',
        '        - SGD with Momentum',
        '        - Weight Decay',
        '        - LSJ',
        '        - SyncBN',
        f"      Training Resources: {setup['hardware']}",
        '      Architecture:',
        '        - LambdaResNet',
        '        - ResNet-RS',
        '        - FPN',
        '        - Mask R-CNN',
        '    Paper:',
        '      URL: https://arxiv.org/abs/2102.08602',
        "      Title: 'LambdaNetworks: Modeling Long-Range Interactions without Attention'",
        '    README: docs/mmdetection.md',
        '',
        'Models:',
    ]
    for row, model, box, _, mask, _ in TABLE14:
        backbone = 'LambdaResNet' if model.startswith('lambda') else 'ResNet-RS'
        lines += [
            f'  - Name: {mmdet_config_name(model)[:-len(".py")]}',
            '    In Collection: LambdaNetworks',
            f'    Config: configs/mmdet/{mmdet_config_name(model)}',
            '    Metadata:',
            f"      Iterations: {setup['steps']}",
            f"      Batch Size: {setup['batch_size']}",
            f"      Image Size: {setup['image_size']}",
            f'      Backbone: {model}  # timm model name; Table 14 row "{row}"',
            '      Architecture:',
            f'        - {backbone}',
            '        - FPN',
            '        - Mask R-CNN',
            '    # Results from the LambdaNetworks paper (Table 14), not produced by these configs; no weights',
            '    Results:',
            '      - Task: Object Detection',
            '        Dataset: COCO',
            '        Metrics:',
            f'          box AP: {box}',
            '      - Task: Instance Segmentation',
            '        Dataset: COCO',
            '        Metrics:',
            f'          mask AP: {mask}',
            '    Paper:',
            '      URL: https://arxiv.org/abs/2102.08602',
            "      Title: 'LambdaNetworks: Modeling Long-Range Interactions without Attention'",
            '    README: docs/mmdetection.md',
            '',
        ]
    return '\n'.join(lines[:-1]) + '\n'


# Arguments train.py reads itself and that make no sense inside a --config YAML.
NOT_IN_YAML = frozenset({'config'})


def _dest_of(call: ast.Call) -> Optional[str]:
    """argparse's dest for one ``add_argument(...)`` call, or None if not statically known."""
    for kw in call.keywords:
        if kw.arg == 'dest':
            if isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                return kw.value.value
            return None
    flags: List[str] = []
    for a in call.args:
        if isinstance(a, ast.Constant) and isinstance(a.value, str):
            flags.append(a.value)
        else:
            return None  # computed option string: not something we can resolve statically
    if not flags:
        return None
    if not flags[0].startswith('-'):
        return flags[0]  # positional
    long_opts = [f for f in flags if f.startswith('--')]
    name = long_opts[0] if long_opts else flags[0]
    return name.lstrip('-').replace('-', '_')


def parse_train_py(source: str) -> List[str]:
    """All dest names of ``<anything>.add_argument(...)`` calls in ``source``, in file order, unique."""
    tree = ast.parse(source)
    calls = [node for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == 'add_argument']
    calls.sort(key=lambda c: (c.lineno, c.col_offset))  # ast.walk is breadth-first
    dests, unresolved = [], []
    for call in calls:
        dest = _dest_of(call)
        if dest is None:
            unresolved.append(call.lineno)
        elif dest not in dests:
            dests.append(dest)
    if unresolved:
        print(f'warning: could not resolve the dest of add_argument calls at lines {unresolved}',
              file=sys.stderr)
    return dests


def read_args_file(path: Path) -> List[str]:
    """Names from a file written by ``--write`` (``#`` lines are comments)."""
    names = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith('#'):
            names.append(line)
    return names


def write_args_file(dests: Iterable[str], source_note: str, path: Path) -> None:
    dests = list(dests)
    header = [
        '# dest names of every add_argument() call in timm\'s train.py (keys a --config YAML may use).',
        f'# Read from: {source_note}',
        '# Generated by tools/timm_train_args.py (static ast parse, train.py is not executed or copied).',
        f'# {len(dests)} names.',
    ]
    path.write_text('\n'.join(header + dests) + '\n')


def check_configs(allowed: Iterable[str], config_dir: Path) -> List[str]:
    """Problems found in configs/timm/*.yaml: unknown keys, unparsable files, no files."""
    import yaml

    allowed = set(allowed) - NOT_IN_YAML
    problems = []
    files = sorted(config_dir.glob('*.yaml'))
    if not files:
        problems.append(f'no *.yaml files in {config_dir}')
    for f in files:
        try:
            cfg = yaml.safe_load(f.read_text())
        except yaml.YAMLError as exc:
            problems.append(f'{f.name}: not valid YAML ({exc})')
            continue
        if not isinstance(cfg, dict):
            problems.append(f'{f.name}: top level is not a mapping')
            continue
        for key in cfg:
            if key not in allowed:
                problems.append(f'{f.name}: key {key!r} is not an argument of train.py')
    return problems


