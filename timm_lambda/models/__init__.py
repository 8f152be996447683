"""LambdaNetworks models registered in timm's model registry."""
from .lambda_resnet import LambdaResNet, LAMBDA_BLOCKS, STAGE_DEPTHS
from .lambda_mobilenetv2 import LambdaMobileNetV2

__all__ = ['LambdaResNet', 'LambdaMobileNetV2', 'LAMBDA_BLOCKS', 'STAGE_DEPTHS']
