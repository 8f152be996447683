"""Files generated from timm_lambda/paper.py and the registry (tools/generate.py) are committed as generated:
configs/timm/*.yaml, the Table 14 configs and their metafile.yml, the README's generated tables. A paper fact
changes in one place."""
from pathlib import Path

import pytest

from _layer_helpers import CUSTOM_OP_FLOPS
from _lib.docs import DOC_BLOCKS, generated_files, render_blocks

REPO = Path(__file__).resolve().parents[1]
GENERATED = generated_files(REPO)


# README's model table counts GMACs with FlopCounterMode, which needs torch >= 2.5 for the position lambdas
@pytest.mark.parametrize('path', [pytest.param(p, marks=CUSTOM_OP_FLOPS) if p == 'README.md' else p
                                  for p in sorted(GENERATED)])
def test_committed_file_equals_generated(path):
    assert (REPO / path).read_text() == GENERATED[path], f'{path} is stale: run python tools/generate.py'


def test_every_recipe_and_config_is_generated():
    on_disk = {f'configs/timm/{p.name}' for p in (REPO / 'configs' / 'timm').glob('*.yaml')}
    on_disk |= {f'configs/mmdet/{p.name}'
                for p in (REPO / 'configs' / 'mmdet').glob('mask-rcnn_*syncbn_*lsj-130k_coco.py')}
    assert on_disk <= set(GENERATED), sorted(on_disk - set(GENERATED))


def test_readme_blocks_are_required():
    with pytest.raises(ValueError, match='generated:models'):
        render_blocks('no blocks here', DOC_BLOCKS['README.md'])


def test_mmdet_metafile_indexes_the_table14_configs():
    """configs/mmdet/metafile.yml in mmdet's format: one Collection with its Paper, one Model per Table 14 config
    (Name, In Collection, an existing Config, Metadata, the paper's box and mask AP as Results, labelled as the
    paper's, and no Weights: no checkpoint of these configs is published)."""
    import yaml

    from timm_lambda.paper import TABLE14
    text = (REPO / 'configs' / 'mmdet' / 'metafile.yml').read_text()
    meta = yaml.safe_load(text)
    note = '# Results from the LambdaNetworks paper (Table 14), not produced by these configs; no weights'
    assert text.count(note) == len(TABLE14)
    (collection,) = meta['Collections']
    assert collection['Paper']['URL'] == 'https://arxiv.org/abs/2102.08602'
    models = {m['Name']: m for m in meta['Models']}
    assert len(models) == len(TABLE14)
    for _, model, box, _, mask, _ in TABLE14:
        name = f"mask-rcnn_{model.replace('_nose', '-nose')}_fpn_syncbn_lsj-130k_coco"
        entry = models[name]
        assert entry['In Collection'] == collection['Name']
        assert entry['Config'] == f'configs/mmdet/{name}.py' and (REPO / entry['Config']).is_file()
        assert entry['Metadata']['Backbone'] == model and entry['Metadata']['Iterations'] == 130000
        assert 'Weights' not in entry and entry['Paper'] == collection['Paper']
        assert (REPO / entry['README']).is_file()
        results = {r['Task']: r for r in entry['Results']}
        assert results['Object Detection']['Dataset'] == results['Instance Segmentation']['Dataset'] == 'COCO'
        assert results['Object Detection']['Metrics'] == {'box AP': box}
        assert results['Instance Segmentation']['Metrics'] == {'mask AP': mask}
