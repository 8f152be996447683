"""Print the README model table: every registered name, parameters, default resolution, and what
it reproduces, next to the paper's parameter count where the paper gives one.

    python tools/model_table.py
    python tools/model_table.py --attention   # LambdaNetworks Table 3, AA paper Tables 3 and 6: ours vs paper
"""
import argparse

import timm

import timm_lambda  # noqa: F401  (registers the models)
from timm_lambda.paper import LAMBDA_BLOCKS, PARAM_COUNTS as PAPER, STAGE_DEPTHS


def describe(name: str) -> str:
    if name.startswith('lambdaresnet') and name.endswith('_c4'):
        return f'LambdaResNet-{name[12:-3]}-C4: every c4/c5 3x3 conv is a lambda layer (E.2, Tables 13, 15, 16)'
    if name.startswith('lambdaresnet'):
        d = int(name[12:])
        return f'LambdaResNet-{d} (Table 19: {"-".join(map(str, STAGE_DEPTHS[d]))}, lambda in c4 blocks {", ".join(map(str, LAMBDA_BLOCKS[d]))} + all c5)'
    if name.startswith('resnetrs'):
        return f'ResNet-RS-{name[8:-5]} without SE (Fig. 4 / Table 13 baseline)'
    return {
        'resnet50_lambda': 'vanilla ResNet-50, every 3x3 conv a lambda layer (Table 3)',
        'resnet50_lambda_u4': 'as above with \\|u\\|=4, scope 7x7 (Table 3)',
        'mobilenetv2_100_lambda': 'MobileNet-v2, blocks 10 and 16 lightweight lambda blocks (E.4.2, Table 17)',
        'aa_resnet34': 'AA-ResNet-34: first 3x3 conv of every c3-c5 block attention augmented, kappa=upsilon=0.25 (AA paper)',
        'aa_resnet50': 'AA-ResNet-50: every c3-c5 3x3 conv attention augmented, kappa=2 upsilon=0.2 (AA paper; Table 3)',
        'aa_resnet101': 'AA-ResNet-101: every c3-c5 3x3 conv attention augmented, kappa=2 upsilon=0.2 (AA paper)',
        'aa_resnet152': 'AA-ResNet-152: every c3-c5 3x3 conv attention augmented, kappa=2 upsilon=0.2 (AA paper)',
        'resnet50_global_attn': 'vanilla ResNet-50, every 3x3 conv global relative self-attention (Table 4)',
        'resnet50_axial_attn': 'vanilla ResNet-50, every 3x3 conv axial self-attention (Table 4)',
        'resnet50_local_attn7': 'vanilla ResNet-50, every 3x3 conv 7x7 local self-attention (Tables 3, 4)',
        'resnet50_lambda_k8': 'resnet50_lambda with \\|k\\|=8 (Table 4)',
        'resnet50_lambda_shared': 'resnet50_lambda with one shared position embedding (Table 4)',
        'resnet50_lambda_conv7': 'resnet50_lambda, 7x7 scope by the lambda convolution (Table 4)',
    }[name]


def _escape(text: str) -> str:
    return text.replace('|', '\\|')


def _vs(ours, paper) -> str:
    return f'{ours:.2f} ({100 * (ours - paper) / paper:+.1f}%)' if paper else f'{ours:.2f}'


def attention_tables():
    """LambdaNetworks Table 3 and the AA paper's Tables 3 and 6: the paper's parameter counts beside ours."""
    from timm_lambda.paper_tables import aa_rows, table3_rows
    print('LambdaNetworks Table 3 (ResNet-50, ImageNet, 224 px):')
    print()
    print('| layer | paper (M) | model | ours (M) | paper top-1 |')
    print('|---|---:|---|---:|---:|')
    for r in table3_rows():
        model = f"`{r['model']}`" if r['model'] else f"not built: {r['note']}"
        ours = _vs(r['ours'], r['paper']) if r['ours'] is not None else '-'
        paper = '-' if r['paper'] is None else r['paper']
        print(f"| {_escape(r['layer'])} | {paper} | {model} | {ours} | {r['top1']} |")
    print()
    print('AA paper (Bello et al. 2019) Table 3 (ResNets, SE-ResNets, AA-ResNets) and Table 6 (AA-ResNet-50):')
    print()
    print('| table | row | model | paper (M) | ours (M) |')
    print('|---|---|---|---:|---:|')
    for r in aa_rows():
        print(f"| {r['table']} | {r['row']} | {r['model']} | {r['paper']} | {_vs(r['ours'], r['paper'])} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description='Print the README model table.')
    parser.add_argument('--attention', action='store_true',
                        help="the attention comparisons (LambdaNetworks Table 3, AA paper Tables 3 and 6) instead")
    if parser.parse_args(argv).attention:
        return attention_tables()
    names = ([f'lambdaresnet{d}' for d in STAGE_DEPTHS] + [f'lambdaresnet{d}_c4' for d in STAGE_DEPTHS]
             + [f'resnetrs{d}_nose' for d in STAGE_DEPTHS] + ['resnet50_lambda', 'resnet50_lambda_u4',
                                                            'mobilenetv2_100_lambda']
             + [f'aa_resnet{d}' for d in (34, 50, 101, 152)]
             + [f'resnet50_{k}' for k in ('global_attn', 'axial_attn', 'local_attn7', 'lambda_k8', 'lambda_shared',
                                          'lambda_conv7')])
    print('| name | params (M) | paper (M) | default res (other tags) | reproduces |')
    print('|---|---|---|---|---|')
    for name in names:
        model = timm.create_model(name)
        n = sum(p.numel() for p in model.parameters()) / 1e6
        paper, where = PAPER.get(name, (None, ''))
        paper_s = f'{paper} ({where}, {100 * (n - paper) / paper:+.1f}%)' if paper else '-'
        tags = sorted(t.split('.')[-1] for t in timm.models.get_arch_pretrained_cfgs(name))
        res = model.pretrained_cfg['input_size'][-1]
        others = [t for t in tags if t != f'r{res}']
        print(f'| `{name}` | {n:.2f} | {paper_s} | {res}' + (f' ({", ".join(others)})' if others else '')
              + f' | {describe(name)} |')


if __name__ == '__main__':
    main()
