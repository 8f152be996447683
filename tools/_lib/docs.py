"""README tables and config files generated from the paper facts (:mod:`timm_lambda.paper`) and the registry,
and the parameter-count comparisons with the papers (LambdaNetworks Table 3, AA paper Tables 3 and 6).

README.md and the docs pages hold generated blocks between ``<!-- generated:NAME -->`` and
``<!-- /generated:NAME -->`` (:data:`DOC_BLOCKS`; the result tables: :mod:`.results`);
:func:`generated_files` returns every generated file's expected text (``tools/generate.py`` writes them,
``tests/test_generated.py`` checks the committed ones).
"""
import re
from pathlib import Path
from typing import Callable, Dict, List

from timm_lambda.paper import AA_TABLE3, AA_TABLE6, LAMBDA_BLOCKS, PARAM_COUNTS, STAGE_DEPTHS, TABLE3, TABLE14, TABLE20

from . import results
from .recipes import all_recipes, mmdet_config_name, mmdet_configs, mmdet_metafile

__all__ = ['model_table', 'forward_macs', 'attention_tables', 'table14_table', 'recipes_table', 'DOC_BLOCKS',
           'render_blocks', 'generated_files', 'TABLE3_MODELS', 'count_params', 'table3_rows', 'aa_rows']


# LambdaNetworks Table 3 layer -> (model, kwargs) that builds it, or (None, why not).
TABLE3_MODELS = {
    'Conv (He et al., 2016)': ('resnet50', {}),
    'Conv + channel attention (Hu et al., 2018)': ('seresnet50', {}),
    'Conv + linear attention (Chen et al., 2018)': (None, 'double attention (A2-Net) blocks'),
    'Conv + linear attention (Shen et al., 2018)': (None, 'efficient attention (the paper gives no count)'),
    'Conv + relative self-attention (Bello et al., 2019)': ('aa_resnet50', {}),
    'Local relative self-attention (Ramachandran et al., 2019)': ('resnet50_local_attn7', {}),
    'Local relative self-attention (Hu et al., 2019)': (
        None, 'local relation networks (LR-Net): another layer (geometry prior, channel sharing)'),
    'Local relative self-attention (Zhao et al., 2020)': (
        None, 'SAN (pairwise/patchwise attention, its own stage layout)'),
    'Lambda layer': ('resnet50_lambda', {}),
    'Lambda layer (|u|=4)': ('resnet50_lambda_u4', {}),
}


def count_params(name: str, **kwargs) -> float:
    """Parameters of ``timm.create_model(name, **kwargs)`` in millions (built on the meta device)."""
    import timm
    model = timm.create_model(name, device='meta', **kwargs)
    return sum(p.numel() for p in model.parameters()) / 1e6


def table3_rows() -> List[dict]:
    """LambdaNetworks Table 3 with our parameter counts: dicts layer, paper, top1, model, ours, note."""
    rows = []
    for layer, paper, top1 in TABLE3:
        model, extra = TABLE3_MODELS[layer]
        ours = count_params(model, **extra) if model else None
        rows.append(dict(layer=layer, paper=paper, top1=top1, model=model, ours=ours,
                         note='' if model else extra))
    return rows


def aa_rows() -> List[dict]:
    """AA paper Tables 3 (ResNets, SE-ResNets, AA-ResNets) and 6 (AA-ResNet-50, kappa = upsilon): dicts
    table, row, model (a create_model call), paper, ours."""
    rows = []
    for depth, counts in AA_TABLE3.items():
        for kind, model in (('resnet', f'resnet{depth}'), ('se', f'seresnet{depth}'), ('aa', f'aa_resnet{depth}')):
            label = {'resnet': f'ResNet-{depth}', 'se': f'SE-ResNet-{depth}', 'aa': f'AA-ResNet-{depth}'}[kind]
            rows.append(dict(table='AA Table 3', row=label, model=f'`{model}`', paper=counts[kind],
                             ours=count_params(model)))
    for ratio, paper in AA_TABLE6.items():
        rows.append(dict(table='AA Table 6', row=f'AA-ResNet-50, kappa = upsilon = {ratio}',
                         model=f'`aa_resnet50`, kappa={ratio}, upsilon={ratio}', paper=paper,
                         ours=count_params('aa_resnet50', kappa=ratio, upsilon=ratio)))
    return rows


def _describe(name: str) -> str:
    if name.startswith('lambdaresnet') and name.endswith('_c4'):
        return f'LambdaResNet-{name[12:-3]}-C4: every c4/c5 3x3 conv is a lambda layer (E.2, Tables 13, 15, 16)'
    if name.startswith('lambdaresnet'):
        d = int(name[12:])
        return (f'LambdaResNet-{d} (Table 19: {"-".join(map(str, STAGE_DEPTHS[d]))}, lambda in c4 blocks '
                f'{", ".join(map(str, LAMBDA_BLOCKS[d]))} + all c5)')
    if name.startswith('resnetrs'):
        return f'ResNet-RS-{name[8:-5]} without SE (Fig. 4 / Table 13 baseline)'
    return {
        'resnet50_lambda': 'vanilla ResNet-50, every 3x3 conv a lambda layer (Table 3)',
        'resnet50_lambda_u4': 'as above with \\|u\\|=4, scope 7x7 (Table 3)',
        'resnet50_lambda_dli14': 'resnet50_lambda with d-li14/lambda.pytorch\'s position bias and padding-counted '
                                 'pooling: the architecture of their ImageNet weights',
        'mobilenetv2_100_lambda': 'MobileNet-v2, blocks 10 and 16 lightweight lambda blocks (E.4.2, Table 17)',
        # the AA paper (Bello et al. 2019) is named in the paper column ("AA Table 3"); rows stay within 200 characters
        'aa_resnet34': 'AA-ResNet-34: first 3x3 conv of each c3-c5 block attention augmented, kappa=upsilon=0.25',
        'aa_resnet50': 'AA-ResNet-50: every c3-c5 3x3 conv attention augmented, kappa=2 upsilon=0.2 (Table 3)',
        'aa_resnet101': 'AA-ResNet-101: every c3-c5 3x3 conv attention augmented, kappa=2 upsilon=0.2',
        'aa_resnet152': 'AA-ResNet-152: every c3-c5 3x3 conv attention augmented, kappa=2 upsilon=0.2',
        'resnet50_global_attn': 'vanilla ResNet-50, every 3x3 conv global relative self-attention (Table 4)',
        'resnet50_axial_attn': 'vanilla ResNet-50, every 3x3 conv axial self-attention (Table 4)',
        'resnet50_local_attn7': 'vanilla ResNet-50, every 3x3 conv 7x7 local self-attention (Tables 3, 4)',
        'resnet50_lambda_k8': 'resnet50_lambda with \\|k\\|=8 (Table 4)',
        'resnet50_lambda_shared': 'resnet50_lambda with one shared position embedding (Table 4)',
        'resnet50_lambda_conv7': 'resnet50_lambda, 7x7 scope by the lambda convolution (Table 4)',
        'resnet50_lambda_global32': 'the CIFAR-10 report\'s model: ResNet-50, lambda layers with global context '
                                    'at 32x32',
        'resnet26_lambda_cifar': 'CIFAR stem (3x3 stride 1, no pooling), blocks 2-2-2-2, every 3x3 a lambda layer',
        # timm's own lambda networks on this package's layer (timm_lambda/models/timm_byoanet.py)
        'lambda_resnet26t_fast': "timm's lambda_resnet26t on this layer, its ImageNet weights (docs/timm_weights.md)",
        'lambda_resnet50ts_fast': "timm's lambda_resnet50ts on this layer, its ImageNet weights (docs/timm_weights.md)",
        'lambda_resnet26rpt_256_fast': "timm's lambda_resnet26rpt_256 on this layer, its ImageNet weights "
                                       '(docs/timm_weights.md)',
        'resnet50_lambda_cifar': 'CIFAR stem, blocks 3-4-6-3, every 3x3 a lambda layer',
    }.get(name, '')


def forward_macs(model, input_size) -> int:
    """Multiply-adds of one forward pass (eval mode) of ``model`` on one ``(C, H, W)`` image of ``input_size``, on
    the model's device (the meta device works: every operator, ours included, has a fake kernel), counted by
    ``torch.utils.flop_counter.FlopCounterMode`` (the position-lambda operators by the FLOP formulas registered in
    timm_lambda/layers/position_lambda/custom_ops.py). ``'auto'`` lambda layers count the form they run at that
    size (dense or tiled)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    device = next(model.parameters()).device
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.eval()(torch.zeros(1, *input_size, device=device))
    return counter.get_total_flops() // 2


def model_table() -> str:
    """Every registered model: parameters (1000 classes), the paper's count, multiply-adds at the default
    resolution beside the paper's FLOPs, default resolution and tags."""
    import timm

    from timm_lambda import registered_models
    from timm_lambda.paper import FLOPS
    order = ([f'lambdaresnet{d}' for d in STAGE_DEPTHS] + [f'lambdaresnet{d}_c4' for d in STAGE_DEPTHS]
             + [f'resnetrs{d}_nose' for d in STAGE_DEPTHS])
    names = [n for n in order if n in registered_models()] + [n for n in registered_models() if n not in order]
    lines = ['| name | params (M) | paper (M) | GMACs | default res (other tags) | reproduces |',
             '|---|---|---|---|---|---|']
    for name in names:
        model = timm.create_model(name, device='meta')
        n = sum(p.numel() for p in model.parameters()) / 1e6
        paper, where = PARAM_COUNTS.get(name, (None, ''))
        paper_s = f'{paper} ({where}, {100 * (n - paper) / paper:+.1f}%)' if paper else '-'
        tags = sorted(t.split('.')[-1] for t in timm.models.get_arch_pretrained_cfgs(name))
        res = model.pretrained_cfg['input_size'][-1]
        macs = forward_macs(model, model.pretrained_cfg['input_size']) / 1e9
        flops, where = FLOPS.get(name, (None, ''))
        macs_s = f'{macs:.2f}'
        if flops:  # the paper's unit as printed: M in Table 17, G elsewhere
            paper_flops = f'{flops * 1000:.0f} MFLOPs' if flops < 1 else f'{flops:.1f} GFLOPs'
            macs_s += f' (paper {paper_flops} = {flops / 2:.2f} GMACs, {where})'
        others = [t for t in tags if t != f'r{res}']
        lines.append(f'| `{name}` | {n:.2f} | {paper_s} | {macs_s} | {res}'
                     + (f' ({", ".join(others)})' if others else '') + f' | {_describe(name)} |')
    return '\n'.join(lines)


def _vs(ours, paper) -> str:
    return f'{ours:.2f} ({100 * (ours - paper) / paper:+.1f}%)' if paper else f'{ours:.2f}'


def attention_tables() -> str:
    """LambdaNetworks Table 3 and the AA paper's Tables 3 and 6: the paper's parameter counts beside ours."""
    lines = ['LambdaNetworks Table 3 (ResNet-50, ImageNet, 224 px):', '',
             '| layer | paper (M) | model | ours (M) | paper top-1 |', '|---|---:|---|---:|---:|']
    for r in table3_rows():
        model = f"`{r['model']}`" if r['model'] else f"not built: {r['note']}"
        ours = _vs(r['ours'], r['paper']) if r['ours'] is not None else '-'
        paper = '-' if r['paper'] is None else r['paper']
        lines.append(f"| {r['layer'].replace('|', chr(92) + '|')} | {paper} | {model} | {ours} | {r['top1']} |")
    lines += ['', 'AA paper (Bello et al. 2019) Table 3 (ResNets, SE-ResNets, AA-ResNets) and Table 6 (AA-ResNet-50):',
              '', '| table | row | model | paper (M) | ours (M) |', '|---|---|---|---:|---:|']
    for r in aa_rows():
        lines.append(f"| {r['table']} | {r['row']} | {r['model']} | {r['paper']} | {_vs(r['ours'], r['paper'])} |")
    return '\n'.join(lines)


def table14_table() -> str:
    """The Table 14 configs with the paper's COCO results beside them."""
    lines = ['| config (configs/mmdet/) | backbone | paper box AP (s/m/l) | paper mask AP (s/m/l) |',
             '|---|---|---|---|']
    for row, model, box, box_sml, mask, mask_sml in TABLE14:
        name = mmdet_config_name(model)
        lines.append(f"| `{name}` (+ `_amp-` variant) | {row} (`{model}`) | {box} ({' / '.join(map(str, box_sml))}) "
                     f"| {mask} ({' / '.join(map(str, mask_sml))}) |")
    return '\n'.join(lines)


def recipes_table() -> str:
    """The timm train.py recipes and the Table 20 rows they reproduce."""
    lines = ['| recipe (configs/timm/) | Table 20 row: RandAugment, dropout, stochastic depth |', '|---|---|']
    for name in sorted(all_recipes()):
        if name.endswith('_350ep.yaml') and name.startswith('lambdaresnet'):
            depth, size = name[12:].split('_r')[0], name.split('_r')[1].split('_')[0]
            ra, drop, dp = TABLE20[int(depth), int(size)]
            lines.append(f'| `{name}` | {depth} @ {size}: {ra}, {drop}, {dp} |')
        else:
            what = ('the CIFAR-10 reproduction report' if 'cifar10' in name else
                    'F.3 90-epoch setup (Table 3)' if '90ep' in name else 'F.3 MobileNet setup (Table 17)')
            lines.append(f'| `{name}` | {what} |')
    return '\n'.join(lines)


# file -> {block name -> generator}: the generated blocks between ``<!-- generated:NAME -->`` and
# ``<!-- /generated:NAME -->`` of each markdown file; a generator returns the block's text, or ``(the JSON it came
# from, the text)`` for a result table (:mod:`.results`), whose opening line then names that JSON
DOC_BLOCKS: Dict[str, Dict[str, Callable[[], object]]] = {
    'README.md': {'models': model_table},
    'docs/training.md': {'recipes': recipes_table},
    'docs/mmdetection.md': {'table14': table14_table},
}
for _page, _blocks in results.BLOCKS.items():
    DOC_BLOCKS.setdefault(_page, {}).update(
        {_name: (lambda page=_page, fn=_fn: results.render(page, fn)) for _name, _fn in _blocks.items()})

# a block: its opening line (the name, and for a result table the JSON it came from), its text, its closing line
BLOCK = re.compile(r'<!-- generated:(?P<name>[\w-]+)(?: from (?P<source>[^>]*?))? -->\n(?:.*?\n)?'
                   r'<!-- /generated:(?P=name) -->', re.S)


def render_blocks(text: str, blocks: Dict[str, Callable[[], object]], name: str = 'README.md') -> str:
    """``text`` with every generated block of ``blocks`` replaced by its current content."""
    for block, fn in blocks.items():
        found = [m for m in BLOCK.finditer(text) if m.group('name') == block]
        if len(found) != 1:
            raise ValueError(f'{name} has {len(found)} <!-- generated:{block} --> ... <!-- /generated:{block} --> '
                             f'blocks, not one')
        out = fn()
        source, body = out if isinstance(out, tuple) else (None, out)
        head = f'<!-- generated:{block}' + (f' from {source}' if source else '') + ' -->'
        m = found[0]
        text = text[:m.start()] + f'{head}\n{body}\n<!-- /generated:{block} -->' + text[m.end():]
    unknown = sorted({m.group('name') for m in BLOCK.finditer(text)} - set(blocks))
    if unknown:
        raise ValueError(f'{name} has generated blocks that nothing generates: {unknown}')
    return text


def generated_files(repo: Path) -> Dict[str, str]:
    """``{path relative to the repository: expected text}`` of every generated file."""
    out = {f'configs/timm/{n}': t for n, t in all_recipes().items()}
    out.update({f'configs/mmdet/{n}': t for n, t in mmdet_configs().items()})
    out['configs/mmdet/metafile.yml'] = mmdet_metafile()
    for rel, blocks in DOC_BLOCKS.items():
        out[rel] = render_blocks((Path(repo) / rel).read_text(), blocks, rel)
    return out
