"""Training recipes generated from the paper facts in :mod:`timm_lambda.paper`, and their checks.

* timm ``train.py`` recipes (``configs/timm/*.yaml``): :func:`all_recipes`;
* MMDetection configs of Table 14 (``configs/mmdet/*.py``): :func:`mmdet_configs`;
* the argument names of timm's ``train.py`` (:func:`parse_train_py`, read with :mod:`ast`, nothing executed),
  against which the YAML keys are checked: ``train.py --config X.yaml`` calls ``parser.set_defaults(**yaml)``,
  so a key that is not one of its arguments would be silently ignored.

``python tools/generate.py`` writes the files; ``tests/test_generated.py`` checks the committed files equal
the generated ones, so a fact changes in one place.
"""
import ast
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from .paper import RESOLUTIONS, TABLE14, TABLE18_TOP1, TABLE20, TABLE3_TOP1

__all__ = ['all_recipes', 'recipe_350', 'recipe_90', 'MOBILENET_RECIPE', 'CIFAR10_RECIPE', 'mmdet_configs', 'parse_train_py',
           'read_args_file', 'write_args_file', 'check_configs', 'NOT_IN_YAML']

_TEMPLATE_350 = '# LambdaResNet-{depth} at {size}x{size}: supervised ImageNet 350-epoch recipe.\n# Source: Bello, "LambdaNetworks", ICLR 2021, appendix F.3 ("Supervised ImageNet 350 epochs training\n# setup") and Table 20 row: depth {depth}, image size {size}, RandAugment magnitude {ra}, dropout {drop},\n# stochastic depth rate {drop_path}. {top1_sentence}\n# Hyper-parameters F.3 does not restate for the 350-epoch setup (SGD momentum 0.9, lr 0.1*B/256\n# linearly warmed up from 0 over 5 epochs then cosine, EMA 0.9999, label smoothing 0.1, bicubic\n# random-resized crop + flip) are those of its 90-epoch setup, which the 350-epoch setup modifies\n# ("weight decay is reduced to 4e-5", plus RandAugment, dropout, stochastic depth).\n#\n#   ./distributed_train.sh 8 --config configs/timm/{filename} --data-dir /path/to/imagenet --grad-accum-steps 4\n#\n# Global batch B = batch_size x world_size x grad_accum_steps. The paper trains with B = 4096 or 2048\n# on 32 or 64 TPUv3 cores "depending on memory constraints" (not given per row): 8 GPUs x 128 x 4\n# accumulation steps = 4096. lr is deliberately NOT set: train.py then computes\n# lr = lr_base * B / lr_base_size = 0.1 * B / 256 (1.6 for B = 4096, 0.8 for B = 2048).\n\n{model_line}\nimg_size: {size:<20}# Table 20 image size (train and eval); input_size not set so --img-size overrides\ninterpolation: bicubic\ntrain_interpolation: bicubic\nbatch_size: 128               # per process; see B above\nepochs: 350\n\n# Optimizer: SGD with momentum 0.9 (timm \'momentum\' = plain momentum; timm\'s \'sgd\' would be Nesterov)\nopt: momentum\nmomentum: 0.9\nweight_decay: 4.0e-5\nlr_base: 0.1\nlr_base_size: 256\nlr_base_scale: linear\n\n# Schedule: linear warm-up from 0 over 5 epochs (per update, not per epoch), then cosine to 0. The cosine is\n# computed over all 350 epochs and the warm-up replaces its first 5 (warmup_prefix false, as the TF reference\n# code): 350 epochs in total, and the lr at the end of warm-up is 0.9995 x peak instead of exactly the peak.\nsched: cosine\nsched_on_updates: true\nwarmup_epochs: 5\nwarmup_lr: 0.0\nwarmup_prefix: false\nmin_lr: 0.0\ncooldown_epochs: 0\n\n# Regularization (Table 20 row)\nsmoothing: 0.1\nmodel_ema: true\nmodel_ema_decay: 0.9999\ndrop: {drop:<24}# dropout before the classifier\ndrop_path: {drop_path:<19}# stochastic depth rate (timm scales it linearly over the blocks)\n\n# Augmentation: random-resized crop + horizontal flip + RandAugment, 2 layers, magnitude {ra}\naa: rand-m{ra}-n2-mmax{ra}-p1.0\nscale: [0.08, 1.0]\nratio: [0.75, 1.3333333333333333]\nhflip: 0.5\ncolor_jitter: 0.0\nreprob: 0.0\nmixup: 0.0\ncutmix: 0.0\n\n# --- What timm cannot express exactly (differences from the paper\'s TPU setup) ---\n# * Batch norm: TPU batch norm is per core (128 images/core for B=4096 on 32 cores); timm\'s default\n#   (no sync_bn) is per process, the same thing when each GPU sees 128 images. BN momentum is not set\n#   (PyTorch\'s default 0.1): F.3 gives a BN decay (0.9999) only for the 90-epoch setup; LambdaResNet\n#   accepts train.py\'s bn_momentum if you want to set one.\n# * Weight decay: timm applies weight_decay to weights only (no decay on biases and 1-D/norm\n#   parameters); the TF reference code decays every non-BN variable. TF L2 loss wd*|w|^2/2 equals\n#   SGD weight_decay=wd, so the value carries over unchanged.\n# * Precision: the TPU runs used bfloat16 activations; add `--amp --amp-dtype bfloat16` on GPUs.\n# * EMA: timm\'s EMA (decay 0.9999) also averages BN buffers; model_ema_warmup is off (F.3 states no\n#   EMA warm-up). Checkpoints keep both the raw and the EMA weights.\n# * Eval crop: crop_pct is left at the model default (0.875); the paper only says models are\n#   "evaluated at the same resolution they are trained at" (Sec. 5.3).\n# * RandAugment: timm\'s op set has no Cutout (TF\'s RandAugment has it) and translates by a fraction of\n#   the image (0.45*M/10) instead of TF\'s 100 px*M/10. `mmax{ra}` lifts timm\'s default magnitude cap\n#   of 10 (without it M=15 is silently clipped to 10, making the M=15 rows identical to M=10) and `p1.0`\n#   applies each of the 2 selected ops always, as in RandAugment (Cubuk et al.) and TF\'s\n#   implementation (timm\'s default applies each op with p=0.5). No `mstd`/`inc`: timm-only variants\n#   the paper does not use.\n'

_TEMPLATE_90 = '# {title}: supervised ImageNet 90-epoch recipe.\n# Source: Bello, "LambdaNetworks", ICLR 2021, appendix F.3 ("Supervised ImageNet 90 epochs training setup\n# with vanilla ResNet") for Table 3 row "{row}" ({top1}% top-1).\n# F.3: SGD momentum 0.9, B = 4096 on 32 TPUv3 cores, weight decay 1e-4, lr linearly from 0 to 0.1*B/256\n# over 5 epochs then cosine, BN decay 0.9999, EMA 0.9999 over the weights, label smoothing 0.1, 224x224,\n# random crops and horizontal flips (p=0.5) only.\n#\n#   ./distributed_train.sh 8 --config configs/timm/{filename} --data-dir /path/to/imagenet --grad-accum-steps 4\n#\n# Global batch B = batch_size x world_size x grad_accum_steps (8 GPUs x 128 x 4 = 4096). lr is NOT set:\n# train.py computes lr = lr_base * B / lr_base_size = 0.1 * B / 256 (1.6 for B = 4096).\n\nmodel: {model}\nimg_size: 224\n# bicubic as the TF/TPU ResNet reference preprocessing; overrides the model\'s pretrained-cfg \'bilinear\'\ninterpolation: bicubic\ntrain_interpolation: bicubic\nbatch_size: 128\nepochs: 90\n\nopt: momentum                 # plain momentum SGD (timm\'s \'sgd\' is Nesterov)\nmomentum: 0.9\nweight_decay: 1.0e-4\nlr_base: 0.1\nlr_base_size: 256\nlr_base_scale: linear\n\nsched: cosine\nsched_on_updates: true        # per-update linear warm-up from 0\nwarmup_epochs: 5\nwarmup_lr: 0.0\nwarmup_prefix: false          # warm-up inside the 90 epochs (cosine over all 90; 0.992 x peak after warm-up)\nmin_lr: 0.0\ncooldown_epochs: 0\n\nsmoothing: 0.1\nmodel_ema: true\nmodel_ema_decay: 0.9999\ndrop: 0.0\ndrop_path: 0.0\n\n# "standard training data augmentation (random crops and horizontal flip with 50% probability)":\n# no RandAugment, no colour jitter (timm\'s default 0.4 would add it), no random erasing/mixup.\nscale: [0.08, 1.0]\nratio: [0.75, 1.3333333333333333]\nhflip: 0.5\ncolor_jitter: 0.0\nreprob: 0.0\n# F.3: batch-norm decay 0.9999 = PyTorch/timm momentum 1 - 0.9999 (applied to every BN, lambda layers too)\nbn_momentum: 0.0001\nmixup: 0.0\ncutmix: 0.0\n\n# --- What timm cannot express exactly ---\n# * Weight decay: timm skips biases and 1-D/norm parameters; the TF reference decays every non-BN variable.\n# * EMA also averages BN buffers in timm; no EMA warm-up (none stated).\n# * Eval crop: model default crop_pct 0.875 (224/256, the usual ResNet centre crop).\n# * TPU bfloat16: add `--amp --amp-dtype bfloat16` on GPUs if wanted.\n'

# Table 17 / F.3 "Mobilenet training setup" (one recipe).
MOBILENET_RECIPE = '# MobileNet-v2 with 2 lightweight lambda blocks (Table 17, 73.3% top-1): ImageNet 350-epoch recipe.\n# Source: Bello, "LambdaNetworks", ICLR 2021, appendix F.3 "Mobilenet training setup": 350 epochs,\n# standard preprocessing, 224x224, "the same hyperparameters as Howard et al. (2019)": RMSProp with\n# momentum 0.9, B = 4096 on 32 TPUv3 cores, lr warmed up linearly to 0.1 then multiplied by 0.99 every\n# 3 epochs, weight decay 1e-5, dropout 0.2.\n#\n#   ./distributed_train.sh 8 --config configs/timm/mobilenetv2_100_lambda_350ep.yaml --data-dir /path/to/imagenet --batch-size 512\n#\n# Global batch B = batch_size x world_size x grad_accum_steps (8 GPUs x 512 = 4096). lr is NOT set:\n# train.py computes lr = lr_base * B / lr_base_size = 0.1 * B / 4096, i.e. 0.1 at the paper\'s B = 4096.\n\nmodel: mobilenetv2_100_lambda.r224\nimg_size: 224\ninterpolation: bicubic\ntrain_interpolation: bicubic\nbatch_size: 512\nepochs: 350\n\n# TF-style RMSProp (epsilon inside the sqrt, as tf.train.RMSPropOptimizer), momentum 0.9, decay (alpha) 0.9\nopt: rmsproptf\nmomentum: 0.9\nopt_eps: 0.001                # not in the paper; TF MnasNet/EfficientNet reference value (timm default 1e-10)\nweight_decay: 1.0e-5\nlr_base: 0.1\nlr_base_size: 4096\nlr_base_scale: linear         # explicit: the lr is specified for B = 4096\n\n# lr x0.99 every 3 epochs (staircase), after a linear warm-up from 0 (length not stated: 5 epochs as the\n# ResNet recipes and the TF reference; warm-up inside the 350 epochs)\nsched: step\nsched_on_updates: true\ndecay_epochs: 3\ndecay_rate: 0.99\nwarmup_epochs: 5\nwarmup_lr: 0.0\nwarmup_prefix: false\nmin_lr: 0.0\ncooldown_epochs: 0\n\ndrop: 0.2\ndrop_path: 0.0\n# Howard et al. (2019) use an EMA of the weights with decay 0.9999 and state no label smoothing.\nmodel_ema: true\nmodel_ema_decay: 0.9999\nsmoothing: 0.0\n\n# "standard preprocessing": random-resized crop + horizontal flip only\nscale: [0.08, 1.0]\nratio: [0.75, 1.3333333333333333]\nhflip: 0.5\ncolor_jitter: 0.0\nreprob: 0.0\nmixup: 0.0\ncutmix: 0.0\n\n# --- What timm cannot express exactly ---\n# * BN momentum: not stated in the paper, so PyTorch\'s default 0.1 applies (bn_momentum is accepted).\n# * Weight decay: timm skips biases and 1-D/norm parameters.\n# * TPU bfloat16: add `--amp --amp-dtype bfloat16` on GPUs if wanted.\n'


# The seed CIFAR-10 reproduction report's setup (paper.CIFAR10_REPORT), for resnet50_lambda_global32 (one recipe).
CIFAR10_RECIPE = '# The CIFAR-10 reproduction report\'s model and training setup (timm_lambda.paper.CIFAR10_REPORT):\n# vanilla ResNet-50 with every 3x3 conv a lambda layer, global context at 32x32 (lambda layers at 8, 4, 2, 1 px),\n# 10 classes; 90 epochs, batch 128, Adam (betas 0.9, 0.9999, L2 weight decay 1e-4), lr 0.0005 x (epoch + 1) for\n# epochs 0-4, then cosine from 0.0025 to 0 over the remaining 85 epochs (per epoch), label smoothing 0.1,\n# random crop + horizontal flip. Report: lambda model 3.2 points below ResNet-50 in test accuracy.\n#\n#   python train.py --config configs/timm/resnet50_lambda_global32_cifar10_90ep.yaml --data-dir /path/to/cifar\n#\n# (timm\'s train.py from its GitHub repo; torchvision downloads CIFAR-10 into --data-dir on the first run.)\n# The CIFAR-stem variants take the same file: add --model resnet50_lambda_cifar (or resnet26_lambda_cifar).\n\nmodel: resnet50_lambda_global32.cifar10\nnum_classes: 10\nimg_size: 32\ndataset: torch/cifar10\ndataset_download: true\ntrain_split: train\nval_split: test\nbatch_size: 128\n\n# The report\'s per-epoch schedule, exactly: warm-up epochs 0-3 at 0.0005, 0.001, 0.0015, 0.002 (timm\'s linear\n# warm-up from warmup_lr to lr), epochs 4-88 cosine from 0.0025 (= 0.0005 x 5) over 85 epochs, epoch 89 at 0\n# (the cosine\'s end, here the cool-down at min_lr). train.py trains warmup + epochs + cooldown = 90 epochs.\n# lr is fixed, not scaled with the batch (the report tuned it at batch 128, section 9.3).\nopt: adam\nopt_betas: [0.9, 0.9999]\nweight_decay: 1.0e-4\nlr: 0.0025\nsched: cosine\nsched_on_updates: false\nwarmup_lr: 0.0005\nwarmup_epochs: 4\nwarmup_prefix: true\nepochs: 85\ncooldown_epochs: 1\nmin_lr: 0.0\n\nsmoothing: 0.1\nmodel_ema: false\ndrop: 0.0\ndrop_path: 0.0\n\n# Augmentation: the report crops 32x32 out of the 4-pixel zero-padded image (a shift of up to 4 px) and flips.\n# timm has no pad-and-crop; the random-resized crop below keeps at least 75% of the image, about as much as\n# the shifted crop shows ((28/32)^2 = 77%), as a zoom of up to 1.15x instead of a shift with black borders.\nscale: [0.75, 1.0]\nratio: [1.0, 1.0]\nhflip: 0.5\ncolor_jitter: 0.0\nreprob: 0.0\nmixup: 0.0\ncutmix: 0.0\ninterpolation: bilinear\ntrain_interpolation: bilinear\ncrop_pct: 1.0                 # evaluation: the whole 32x32 image, as the report (no resize, no centre crop)\n\n# --- What timm cannot express exactly ---\n# * Weight decay: timm skips biases and norm parameters; the report\'s Adam decays every parameter.\n# * Normalisation: mean/std come from the model\'s pretrained cfg (the report\'s values, timm_lambda.paper).\n# * The report\'s BatchNorm momentum=0.9999 (PyTorch convention: running statistics ~ the last batch\'s) is not\n#   reproduced; timm keeps PyTorch\'s default 0.1.\n# * Architecture: the report\'s position embeddings are absolute (one |n| x |m| x |k| table per resolution) and\n#   its batch norms run over context positions (values) and |k| (queries); this model uses the paper\'s\n#   translation-equivariant relative table (one, shared) and per-channel batch norms (README "Small inputs").\n'


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
    return _TEMPLATE_350.format(depth=depth, size=size, ra=ra, drop=drop, drop_path=drop_path, top1_sentence=sentence,
                                filename=f'lambdaresnet{depth}_r{size}_350ep.yaml', model_line=model_line)


def recipe_90(model: str) -> str:
    """The 90-epoch vanilla-ResNet recipe (F.3) for a Table 3 lambda model."""
    title, row = {
        'resnet50_lambda': ('ResNet-50 with every 3x3 conv replaced by a lambda layer', 'Lambda layer'),
        'resnet50_lambda_u4': ('ResNet-50 with lambda layers, intra-depth |u|=4, scope 7x7', 'Lambda layer (|u|=4)'),
    }[model]
    return _TEMPLATE_90.format(title=title, row=row, top1=TABLE3_TOP1[row], filename=f'{model}_90ep.yaml',
                               model=f'{model}.r224')


def all_recipes() -> Dict[str, str]:
    """``{file name: YAML text}`` of every recipe in configs/timm/."""
    out = {f'lambdaresnet{d}_r{s}_350ep.yaml': recipe_350(d, s) for (d, s) in TABLE20 if s in RESOLUTIONS[d]}
    out.update({f'{m}_90ep.yaml': recipe_90(m) for m in ('resnet50_lambda', 'resnet50_lambda_u4')})
    out['mobilenetv2_100_lambda_350ep.yaml'] = MOBILENET_RECIPE
    out['resnet50_lambda_global32_cifar10_90ep.yaml'] = CIFAR10_RECIPE
    return out


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
        name = f"mask-rcnn_{model.replace('_nose', '-nose')}_fpn_syncbn_lsj-130k_coco.py"
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


