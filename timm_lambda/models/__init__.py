"""LambdaNetworks models and the attention baselines they are compared with, registered in timm's model registry."""
from .lambda_resnet import LambdaResNet
from .lambda_mobilenetv2 import LambdaMobileNetV2
from .attention_resnet import AttentionResNet
from .cifar import CifarLambdaResNet

__all__ = ['LambdaResNet', 'LambdaMobileNetV2', 'AttentionResNet', 'CifarLambdaResNet']
