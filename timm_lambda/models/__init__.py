"""LambdaNetworks models registered in timm's model registry."""
from .lambda_resnet import LambdaResNet
from .lambda_mobilenetv2 import LambdaMobileNetV2
from .cifar import CifarLambdaResNet

__all__ = ['LambdaResNet', 'LambdaMobileNetV2', 'CifarLambdaResNet']
