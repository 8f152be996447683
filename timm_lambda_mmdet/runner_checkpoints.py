"""Opt-in: let torch >= 2.6 ``weights_only`` loading accept the checkpoints mmengine's Runner writes.

Importing this module adds exactly the globals a Runner checkpoint holds to torch's allow-list, for the whole
process (:func:`timm_lambda_mmdet.checkpoint_compat.register_safe_globals`); the configs of this project list it
in ``custom_imports``, so mmdet's own ``tools/train.py --resume`` and ``tools/test.py`` can load them.
Importing ``timm_lambda_mmdet`` alone changes nothing in torch.
"""
from .checkpoint_compat import register_safe_globals

register_safe_globals()
