"""Run MMDetection's own ``tools/train.py`` / ``tools/test.py`` (shipped inside the mmdet wheel) on a config.

    python -m timm_lambda_mmdet train CONFIG [mmdet train.py arguments]
    python -m timm_lambda_mmdet test CONFIG CHECKPOINT [mmdet test.py arguments]
    torchrun --nproc-per-node 8 -m timm_lambda_mmdet train CONFIG --launcher pytorch

Nothing is re-implemented: the scripts are mmdet's, unchanged (a source checkout of mmdet has the same files in
its ``tools/``). The configs of this project import :mod:`timm_lambda_mmdet` through ``custom_imports``.
"""
import os.path as osp
import runpy
import sys

SCRIPTS = ('train', 'test')


def mmdet_script(name: str) -> str:
    """Path of mmdet's own ``tools/<name>.py`` in the installed mmdet."""
    import mmdet
    path = osp.join(osp.dirname(mmdet.__file__), '.mim', 'tools', f'{name}.py')
    if not osp.isfile(path):
        raise FileNotFoundError(f'mmdet {mmdet.__version__} has no {path}; use tools/{name}.py of an mmdet '
                                'source checkout instead')
    return path


CPU_DDP = 'timm_lambda_mmdet.cpu_distributed'


def check_cpu_launch(argv) -> None:
    """``--launcher pytorch`` (torchrun) on a machine without an accelerator with a config that does not import
    :mod:`timm_lambda_mmdet.cpu_distributed`: a SystemExit naming the ``_cpu-ddp`` config, instead of mmengine's
    ``Found no NVIDIA driver`` (its ``_init_dist_pytorch`` sets a CUDA device unconditionally) once per process."""
    launcher = next((a.split('=', 1)[1] if '=' in a else argv[i + 1] for i, a in enumerate(argv)
                     if (a == '--launcher' and i + 1 < len(argv)) or a.startswith('--launcher=')), 'none')
    if launcher != 'pytorch' or len(argv) < 2:
        return
    import torch
    from mmengine.config import Config
    from mmengine.device import is_mlu_available, is_musa_available, is_npu_available
    if torch.cuda.is_available() or is_mlu_available() or is_npu_available() or is_musa_available():
        return
    imports = Config.fromfile(argv[1], import_custom_modules=False).get('custom_imports', {}).get('imports', [])
    if CPU_DDP in ([imports] if isinstance(imports, str) else imports):
        return
    raise SystemExit(
        f'timm_lambda_mmdet: --launcher pytorch on a machine without a GPU needs a CPU config: use the _cpu-ddp one '
        f'(configs/mmdet/mask-rcnn_lambdaresnet101_fpn_syncbn_lsj-130k_coco_cpu-ddp.py) or set its three keys in '
        f"yours ({CPU_DDP} in custom_imports, model_wrapper_cfg=dict(type='CPUCompatibleDDP'), "
        f"env_cfg=dict(dist_cfg=dict(backend='gloo'))); {argv[1]} would stop at mmengine's 'Found no NVIDIA driver'")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SCRIPTS:
        raise SystemExit(f'usage: python -m timm_lambda_mmdet {{{",".join(SCRIPTS)}}} CONFIG [...] '
                         "(arguments of mmdet's tools/train.py or tools/test.py)")
    check_cpu_launch(argv)
    script = mmdet_script(argv[0])
    sys.argv = [script] + argv[1:]
    runpy.run_path(script, run_name='__main__')


if __name__ == '__main__':
    main()
