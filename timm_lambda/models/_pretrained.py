"""The pretrained cfg every model of this package starts from (timm's ``default_cfgs`` entries).

None of our cfgs has weights to download: they state preprocessing, the paper and the license. ``license`` is
this project's, Apache-2.0 (the license of the paper's code too), unless a cfg names weights of another origin.
Models that refuse inputs larger than the ones their position tables were sized for (global scopes, AA-ResNets,
global and axial attention) set ``fixed_input_size``: timm then passes ``input_size`` on as ``img_size``.
"""
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

__all__ = ['cfg', 'LAMBDANETWORKS', 'AA_PAPER', 'RESNETRS_PAPER']

LAMBDANETWORKS = dict(paper_ids='arXiv:2102.08602',
                      paper_name='LambdaNetworks: Modeling Long-Range Interactions without Attention')
AA_PAPER = dict(paper_ids='arXiv:1904.09925', paper_name='Attention Augmented Convolutional Networks')
RESNETRS_PAPER = dict(paper_ids='arXiv:2103.07579')


def cfg(res: int = 224, **kwargs) -> dict:
    """ImageNet at ``res`` x ``res`` (F.1: trained and evaluated at the same resolution, so no separate
    ``test_input_size``), 1000 classes, bicubic, crop 0.875, output stride 32, timm's ResNet names, Apache-2.0;
    ``kwargs`` override any entry."""
    return {
        'num_classes': 1000, 'input_size': (3, res, res), 'pool_size': (res // 32, res // 32), 'crop_pct': 0.875,
        'interpolation': 'bicubic', 'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'conv1', 'classifier': 'fc', 'license': 'apache-2.0', **LAMBDANETWORKS, **kwargs,
    }
