"""Which of timm's own model tests (tests/test_timm_suite.py) run on which of our models.

- timm's own CI leaves its deepest ResNet-RS models out of every test (``EXCLUDE_FILTERS``: ``*resnetrs350*``,
  ``*resnetrs420*``): ours on those depths are left out the same way (:data:`EXCLUDE_FILTERS`); tests/test_models.py
  runs timm's forward and backward checks on them (``test_deepest_models_forward_backward``).
- The FX and TorchScript tests run on one member of each family of models that differ only in depth (and default
  resolution): the same blocks traced and scripted again at a greater depth test nothing new, and on the deep
  members they were most of the suite's time (lambdaresnet420_c4: 31-37 s per FX test on one core; timm's CI
  leaves ``resnetrs270`` out of its FX tests for the same reason).
- timm's two tests that download each ``pretrained=True`` model's weights (``test_model_load_pretrained``,
  ``test_model_features_pretrained``; timm's own GitHub CI skips them too) are left out: CI has no network.
  tests/test_timm_byoanet.py loads timm's files into the ``_fast`` models through the same machinery from a local file.
- Every other test runs on every model.
Set ``TIMM_LAMBDA_TIMM_SUITE_ALL=1`` to run every test on every model.
"""
import fnmatch
import re

from timm_lambda._env import env

# timm: EXCLUDE_FILTERS += ['*resnetrs350*', '*resnetrs420*'] (its GitHub Actions list)
EXCLUDE_FILTERS = ('lambdaresnet350*', 'lambdaresnet420*', 'resnetrs350_nose', 'resnetrs420_nose')
DOWNLOAD_TESTS = ('test_model_load_pretrained', 'test_model_features_pretrained')
FX_TS_TESTS = ('test_model_forward_fx', 'test_model_backward_fx', 'test_model_forward_fx_torchscript',
               'test_model_forward_torchscript')
# family (the model name with its depth as \d+): the members whose FX and TorchScript tests run
FX_TS_REPRESENTATIVES = {
    r'lambdaresnet\d+': ('lambdaresnet50',),
    r'lambdaresnet\d+_c4': ('lambdaresnet50_c4',),
    r'resnetrs\d+_nose': ('resnetrs50_nose',),
    r'aa_resnet\d+': ('aa_resnet34', 'aa_resnet50'),  # BasicBlock and Bottleneck
    r'lambda_resnet\w+_fast': ('lambda_resnet26t_fast', 'lambda_resnet26rpt_256_fast'),  # local and global scopes
}


def excluded(test_name: str, model_name: str) -> bool:
    """Whether timm's test ``test_name`` leaves our model ``model_name`` out."""
    if env('TIMM_LAMBDA_TIMM_SUITE_ALL'):
        return False
    if _deepest(model_name) or test_name in DOWNLOAD_TESTS:
        return True
    if test_name not in FX_TS_TESTS:
        return False
    for family, members in FX_TS_REPRESENTATIVES.items():
        if re.fullmatch(family, model_name):
            return model_name not in members
    return False


def _deepest(model_name: str) -> bool:
    return any(fnmatch.fnmatch(model_name, f) for f in EXCLUDE_FILTERS)


def excluded_models(names) -> list:
    """The models of ``names`` that timm's suite leaves out of every test (:data:`EXCLUDE_FILTERS`)."""
    return [n for n in names if _deepest(n)]
