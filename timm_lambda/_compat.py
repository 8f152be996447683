"""Version floors and the few shims that let timm-lambda run on older torch / timm.

The floors are the versions below which this package cannot import; ``tools/test_version_floors.sh`` runs the
non-mmdet tests on them (its result, in docs/install.md: passing, the dynamo ONNX exporter skipped where torch's
own cannot export a plain Conv + BatchNorm). pyproject.toml declares the same numbers.
:func:`check_versions` runs first thing in ``timm_lambda/__init__.py`` so that an older install fails
with an error that says what to upgrade (the ``.pth`` hook, ``timm_lambda_autoload``, prints it) instead
of an ``AttributeError`` from deep inside an import.

Each shim names the version from which the real API exists; drop it when the floor passes that version.
"""
import re
from typing import Optional, Tuple

import torch
from torch import nn

# Keep in step with pyproject.toml's dependencies and docs/install.md.
MIN_TORCH = '2.4'   # torch.library.custom_op / register_fake / register_autograd, torch.get_autocast_dtype
MIN_TIMM = '1.0.21'  # device=/dtype= factory kwargs in ResNet, EfficientNet, their blocks, BottleneckAttn, ...


class VersionTooOld(ImportError):
    """An installed torch or timm is older than timm-lambda's floor. Its message says what to upgrade."""


def parse_version(version: str) -> Tuple[int, ...]:
    """The leading numeric release of a version string: '2.4.1+cu121' -> (2, 4, 1), '2.6.0a0+git1' -> (2, 6, 0)."""
    m = re.match(r'\d+(?:\.\d+)*', version.strip())
    return tuple(int(p) for p in m.group(0).split('.')) if m else ()


def _older(version: str, floor: str) -> bool:
    have, need = parse_version(version), parse_version(floor)
    width = max(len(have), len(need))
    return have + (0,) * (width - len(have)) < need + (0,) * (width - len(need))


def check_versions(torch_version: Optional[str] = None, timm_version: Optional[str] = None) -> None:
    """Raise :class:`VersionTooOld` naming the installed and required versions if torch or timm is too old.

    The versions default to ``torch.__version__`` and ``timm.__version__``.
    """
    if torch_version is None:
        torch_version = torch.__version__
    if timm_version is None:
        import timm
        timm_version = timm.__version__
    old = []
    if _older(torch_version, MIN_TORCH):
        old.append(('torch', torch_version, MIN_TORCH))
    if _older(timm_version, MIN_TIMM):
        old.append(('timm', timm_version, MIN_TIMM))
    if not old:
        return
    found = ', '.join(f'{name} {have} (needs >= {need})' for name, have, need in old)
    # torchvision must match torch: upgrade it along with torch.
    specs = ' '.join(f'"{name}>={need}"' + (' torchvision' if name == 'torch' else '') for name, _, need in old)
    raise VersionTooOld(f'timm-lambda needs torch >= {MIN_TORCH} and timm >= {MIN_TIMM}; installed: {found}. '
                        f'Upgrade with: pip install -U {specs}')


def register_load_state_dict_pre_hook(module: nn.Module, hook) -> None:
    """``module.register_load_state_dict_pre_hook(hook)``, public since torch 2.5; before that the private
    ``_register_load_state_dict_pre_hook(hook, with_module=True)`` calls ``hook`` with the same arguments."""
    public = getattr(module, 'register_load_state_dict_pre_hook', None)
    if public is not None:
        public(hook)
    else:
        module._register_load_state_dict_pre_hook(hook, with_module=True)


# torch.compile traces torch._C._are_functorch_transforms_active() (folds it to a constant) since torch 2.5;
# torch 2.4's dynamo stops at it ("torch.* op returned non-Tensor bool"). There, code being compiled treats it
# as False (no torch.func transform around a compiled region), so torch.compile works; torch.compile inside a
# torch.func transform on torch 2.4 then runs the kernels, which have no batching rules, and fails.
DYNAMO_FOLDS_FUNCTORCH_FLAG = not _older(torch.__version__, '2.5')
