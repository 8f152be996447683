"""Torch-only repro: AOTInductor gets the output size of a ``ceil_mode`` average pool wrong at odd input sizes.

``nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)`` is timm's ResNet-D shortcut pool (``avg_down``:
every LambdaResNet, ResNet-RS and timm's own ``resnet50d``). Exported with ``Dim.AUTO`` height and width and
compiled by ``torch._inductor.aoti_compile_and_package``, the package returns ``floor(H / 2)`` rows where eager,
``torch.export``'s own module and ``torch.compile(dynamic=True)`` return ``ceil(H / 2)``. In a whole network the
short map is read as if it were full size, and the output is NaN (a LambdaResNet-50 package at 33x33 and
100x150 px; exact at multiples of 32, where every pooled map is even). Prints one line per size and exits 1
if any size is wrong (measured: torch 2.14.1, CPU).

    python tools/repro_aoti_ceil_pool.py
"""
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.export import Dim


def main() -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)).eval()
    dims = ({0: Dim.AUTO, 2: Dim.AUTO, 3: Dim.AUTO},)
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter('ignore')
        ep = torch.export.export(model, (torch.randn(2, 3, 16, 16),), dynamic_shapes=dims)
        runner = torch._inductor.aoti_load_package(
            torch._inductor.aoti_compile_and_package(ep, package_path=str(Path(tmp) / 'pool.pt2')))
        bad = 0
        for hw in [(16, 16), (17, 17), (9, 12)]:
            x = torch.randn(1, 3, *hw)
            with torch.no_grad():
                got, want, exported = runner(x), model(x), ep.module()(x)
            ok = got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
            bad += not ok
            print(f'{hw}: eager {tuple(want.shape)}, torch.export {tuple(exported.shape)}, '
                  f'AOTInductor {tuple(got.shape)}: {"ok" if ok else "WRONG"}')
    print(f'torch {torch.__version__}: AOTInductor ceil_mode pool ' + ('wrong' if bad else 'right'))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
