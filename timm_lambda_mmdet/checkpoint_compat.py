"""Let torch >= 2.6 ``weights_only`` loading accept mmengine checkpoints.

mmengine 0.10.7 calls ``torch.load(filename, map_location=...)`` without
``weights_only``; since torch 2.6 that means ``weights_only=True``, and the
checkpoints mmengine's own Runner writes are refused on ``resume`` and in
``tools/test.py``::

    WeightsUnpickler error: Unsupported global: GLOBAL
    mmengine.logging.history_buffer.HistoryBuffer

Rather than turning safe loading off for the whole program, we add exactly
the globals a Runner checkpoint (mmdet Mask R-CNN, SGD, param schedulers,
message hub) contains to torch's allow-list. The list was obtained by saving
a real Runner checkpoint and loading it with ``weights_only=True``
(``tests/test_mmdet_e2e.py`` loads a fresh one with ``weights_only=True``, then resumes and tests from it).
"""
import collections
import importlib
import os.path as osp
import pickle
import zipfile

import numpy as np
import torch


def _numpy_globals():
    out = [np.ndarray, np.dtype]
    # Array/scalar reconstruction helpers: numpy >= 2 lives in numpy._core,
    # numpy 1.x in numpy.core; a checkpoint names the module of the numpy
    # that wrote it, so allow whichever spellings exist here.
    for modname in ('numpy._core.multiarray', 'numpy.core.multiarray'):
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        for fn in ('_reconstruct', 'scalar'):
            if hasattr(mod, fn):
                out.append((getattr(mod, fn), f'{modname}.{fn}'))
    # numpy >= 1.25 restores a dtype's state on its concrete class
    # (numpy.dtypes.Float64DType, Int64DType, ...): allow the numeric and
    # bool ones, which is what the loss/lr histories hold.
    dtypes = getattr(np, 'dtypes', None)
    for name in dir(dtypes) if dtypes is not None else ():
        cls = getattr(dtypes, name)
        scalar_type = getattr(cls, 'type', None)
        if (isinstance(cls, type) and issubclass(cls, np.dtype)
                and isinstance(scalar_type, type)
                and issubclass(scalar_type, (np.number, np.bool_))):
            out.append(cls)
    return out


def _history_buffer_getattr(obj, name):
    """Stand-in for ``builtins.getattr`` while unpickling.

    ``HistoryBuffer.__getstate__`` stores its statistics methods, which
    pickle as ``getattr(HistoryBuffer, 'min')`` etc. Allowing the real
    ``getattr`` would let a crafted file reach any attribute (and from there
    ``__globals__``), so only attribute look-ups of registered HistoryBuffer
    statistics methods are served.
    """
    from mmengine.logging import HistoryBuffer
    allowed = {'min', 'max', 'current', 'mean'}
    allowed.update(HistoryBuffer._statistics_methods)
    if obj is HistoryBuffer and name in allowed:
        return getattr(obj, name)
    raise pickle.UnpicklingError(
        f'weights_only load refused getattr({obj!r}, {name!r}): '
        'mmdet_plugin only allows HistoryBuffer statistics methods')


def mmengine_checkpoint_globals():
    """What mmengine Runner checkpoints pickle beyond tensors and builtins:
    ``meta.message_hub`` holds HistoryBuffers (numpy arrays, statistics
    methods), ``param_schedulers`` hold ``collections.Counter`` milestones.
    """
    from mmengine.logging import HistoryBuffer
    return ([HistoryBuffer, collections.Counter,
             (_history_buffer_getattr, 'builtins.getattr')]
            + _numpy_globals())


def register_safe_globals():
    """Allow-list mmengine checkpoint globals for ``torch.load`` (``add_safe_globals``: torch >= 2.4, the floor)."""
    globs = mmengine_checkpoint_globals()
    torch.serialization.add_safe_globals(globs)
    return globs


def check_checkpoint_file(path: str, what: str) -> None:
    """Errors naming ``what`` (the setting) and the file for a local checkpoint that is missing, empty or a
    truncated zip (torch's format), instead of torch's bare ``EOFError`` or miniz's "failed finding central
    directory". URLs are left to the downloader."""
    if '://' in str(path):
        return
    if not osp.isfile(path):
        raise FileNotFoundError(f"{what}: checkpoint file '{path}' does not exist")
    if osp.getsize(path) == 0:
        raise ValueError(f"{what}: checkpoint file '{path}' is empty (0 bytes); was its save or copy interrupted?")
    with open(path, 'rb') as f:
        is_zip_start = f.read(4) == b'PK\x03\x04'
    if is_zip_start and not zipfile.is_zipfile(path):
        raise ValueError(f"{what}: checkpoint file '{path}' is truncated (a zip archive without its end); was its "
                         'save or copy interrupted?')
