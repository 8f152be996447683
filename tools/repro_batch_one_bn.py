"""Torch-only repro of the CPU batch-norm backward bug that timm_lambda/layers/batch_one.py works around.

``F.batch_norm`` -> ``reshape(B, C, n)`` -> ``transpose(1, 2)`` -> ``matmul``: at B == 1 the gradient that
reaches batch norm has strides ``(C, 1, W*C, C)`` (channels-last by ``is_contiguous``, batch stride C), and
the CPU kernel returns a wrong input gradient. Prints one line per case and exits 1 if any gradcheck fails.

    python tools/repro_batch_one_bn.py
"""
import sys

import torch
import torch.nn.functional as F


def check(batch: int, training: bool) -> bool:
    g = torch.Generator().manual_seed(0)
    C, H, W = 8, 5, 4
    x = torch.randn(batch, C, H, W, dtype=torch.float64, generator=g, requires_grad=True)
    weight, bias = torch.randn(C, dtype=torch.float64, generator=g), torch.randn(C, dtype=torch.float64, generator=g)
    mean, var = torch.randn(C, dtype=torch.float64, generator=g), torch.rand(C, dtype=torch.float64, generator=g) + 0.5
    other = torch.randn(batch, 3, H * W, dtype=torch.float64, generator=g)

    def f(x):
        y = F.batch_norm(x, None if training else mean, None if training else var, weight, bias, training=training)
        return torch.matmul(other, y.reshape(batch, C, H * W).transpose(1, 2))

    return torch.autograd.gradcheck(f, (x,), raise_exception=False)


def main() -> int:
    print(f'torch {torch.__version__}')
    ok = True
    for training in (True, False):
        for batch in (1, 2):
            passed = check(batch, training)
            ok &= passed
            print(f'batch={batch} {"train" if training else "eval "}: {"ok" if passed else "WRONG input gradient"}')
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
