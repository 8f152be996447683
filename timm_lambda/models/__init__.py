"""LambdaNetworks models and the attention baselines they are compared with, registered in timm's model registry."""
from .attention_resnet import AttentionResNet
from .cifar import CifarLambdaResNet
from .lambda_mobilenetv2 import LambdaMobileNetV2
from .lambda_resnet import LambdaResNet
from .timm_byoanet import TimmLambdaLayer, checkpoint_filter_timm_lambda_layers, convert_timm_lambda_layers

__all__ = ['LambdaResNet', 'LambdaMobileNetV2', 'AttentionResNet', 'CifarLambdaResNet', 'TimmLambdaLayer',
           'convert_timm_lambda_layers', 'checkpoint_filter_timm_lambda_layers']
