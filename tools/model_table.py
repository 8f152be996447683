"""Print the README model table: every registered name, parameters, default resolution, and what
it reproduces, next to the paper's parameter count where the paper gives one.

    python tools/model_table.py
"""
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
    }[name]


def main():
    names = ([f'lambdaresnet{d}' for d in STAGE_DEPTHS] + [f'lambdaresnet{d}_c4' for d in STAGE_DEPTHS]
             + [f'resnetrs{d}_nose' for d in STAGE_DEPTHS] + ['resnet50_lambda', 'resnet50_lambda_u4',
                                                            'mobilenetv2_100_lambda'])
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
