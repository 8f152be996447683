"""Files generated from timm_lambda/paper.py and the registry (tools/generate.py) are committed as generated:
configs/timm/*.yaml, the Table 14 configs, the README's generated tables. A paper fact changes in one place."""
from pathlib import Path

import pytest

from timm_lambda.docs import generated_files, render_readme

REPO = Path(__file__).resolve().parents[1]
GENERATED = generated_files(REPO)


@pytest.mark.parametrize('path', sorted(GENERATED))
def test_committed_file_equals_generated(path):
    assert (REPO / path).read_text() == GENERATED[path], f'{path} is stale: run python tools/generate.py'


def test_every_recipe_and_config_is_generated():
    on_disk = {f'configs/timm/{p.name}' for p in (REPO / 'configs' / 'timm').glob('*.yaml')}
    on_disk |= {f'configs/mmdet/{p.name}' for p in (REPO / 'configs' / 'mmdet').glob('mask-rcnn_*syncbn_*lsj-130k_coco.py')}
    assert on_disk <= set(GENERATED), sorted(on_disk - set(GENERATED))


def test_readme_blocks_are_required():
    with pytest.raises(ValueError, match='generated:models'):
        render_readme('no blocks here')
