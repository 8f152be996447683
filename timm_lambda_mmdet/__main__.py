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


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SCRIPTS:
        raise SystemExit(f'usage: python -m timm_lambda_mmdet {{{",".join(SCRIPTS)}}} CONFIG [...] '
                         "(arguments of mmdet's tools/train.py or tools/test.py)")
    script = mmdet_script(argv[0])
    sys.argv = [script] + argv[1:]
    runpy.run_path(script, run_name='__main__')


if __name__ == '__main__':
    main()
