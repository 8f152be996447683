"""Opt-in: let mmengine's ``--launcher pytorch`` start process groups on machines without an accelerator.

Importing this module (the CPU config ``configs/mmdet/*_cpu-ddp.py`` lists it in
``custom_imports``) calls :func:`timm_lambda_mmdet.ddp.enable_cpu_process_groups`; importing
``timm_lambda_mmdet`` alone changes nothing in mmengine.
"""
from .ddp import enable_cpu_process_groups

enable_cpu_process_groups()
