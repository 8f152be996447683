"""LambdaNetworks models and the attention baselines they are compared with, registered in timm's model registry."""
from .attention_resnet import AttentionResNet
from .cifar import CifarLambdaResNet
from .lambda_mobilenetv2 import LambdaMobileNetV2
from .lambda_resnet import LambdaResNet

__all__ = ['LambdaResNet', 'LambdaMobileNetV2', 'AttentionResNet', 'CifarLambdaResNet']
