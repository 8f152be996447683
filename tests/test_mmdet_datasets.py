"""CheckedCocoDataset: problems with the annotation files are reported with the file and the problem."""
import _det  # noqa: F401  (skips this module without the [det] extra)

# isort: split
import json

import pytest
from mmdet.registry import DATASETS
from mmdet.utils import register_all_modules

import timm_lambda_mmdet  # noqa: F401
from _lib.synthetic_coco import make_coco_dataset
from _mmdet_helpers import CLASSES

register_all_modules()


def build(ann_file, classes=CLASSES, filter_empty_gt=True, **kw):
    return DATASETS.build(dict(type='CheckedCocoDataset', ann_file=str(ann_file), data_prefix=dict(img=''),
                               metainfo=dict(classes=classes), filter_cfg=dict(filter_empty_gt=filter_empty_gt),
                               pipeline=[], test_mode=False, **kw))


@pytest.fixture(scope='module')
def ann(tmp_path_factory):
    return make_coco_dataset(str(tmp_path_factory.mktemp('coco')), num_train=6, num_val=2, image_size=96)['train']


def test_valid_file_loads(ann):
    ds = build(ann)
    assert 0 < len(ds) <= 6


def test_malformed_json_names_file_line_and_column(tmp_path, ann):
    text = open(ann).read()
    broken = tmp_path / 'broken.json'
    broken.write_text(text + '\n}')  # extra data on line 2
    with pytest.raises(ValueError, match=rf'{broken}:2:\d+: malformed JSON'):
        build(broken)


def test_classes_matching_no_category(ann):
    with pytest.raises(ValueError, match=r"none of metainfo.classes \['person', 'car'\].*square"):
        build(ann, classes=('person', 'car'))


def test_misspelt_class_is_an_error_naming_it_and_the_categories(ann):
    """One misspelt name among correct ones used to be a warning, and that class trained silently empty."""
    with pytest.raises(ValueError, match=r"instances_train.json: metainfo.classes \['Star'\] match no category.*"
                                         r"did you mean \{'Star': 'star'\}.*its categories: \['square', 'circle', "
                                         r"'triangle', 'star'\].*allow_missing_classes=True"):
        build(ann, classes=('square', 'circle', 'triangle', 'Star'))
    full = build(ann)
    with pytest.warns(UserWarning, match=r"\['Star'\] match no category"):
        ds = build(ann, classes=('square', 'circle', 'triangle', 'Star'), allow_missing_classes=True)
    assert ds.cat_ids == full.cat_ids[:3]  # on purpose: trains without the unmatched class
    with pytest.raises(ValueError, match='allow_missing_classes must be True or False'):
        build(ann, allow_missing_classes='yes')


@pytest.mark.parametrize('content,problem', [
    (lambda d: d['images'], 'holds a JSON array, not a COCO object'),
    (lambda d: 'instances', 'holds a JSON string, not a COCO object'),
    (lambda d: {k: v for k, v in d.items() if k != 'categories'}, r'has no list of categories .*its keys: '
                                                                   r"\['annotations', 'images'"),
    (lambda d: {k: v for k, v in d.items() if k not in ('images', 'categories')}, 'has no list of images and '
                                                                                  'categories'),
], ids=['list', 'string', 'no_categories', 'no_images'])
def test_annotation_file_that_is_not_coco_names_the_file(tmp_path, ann, content, problem):
    """Instead of pycocotools' AssertionError ('annotation file format <class 'list'> not supported') and
    mmdet's KeyError: 'categories'."""
    bad = tmp_path / 'bad.json'
    bad.write_text(json.dumps(content(json.loads(open(ann).read()))))
    with pytest.raises(ValueError, match=rf'{bad}: the annotation file {problem}'):
        build(bad)


def _without_bbox(d):
    d['annotations'][0].pop('bbox')
    return d


@pytest.mark.parametrize('content,problem', [
    (_without_bbox, r"an entry lacks the key 'bbox'"),
    (lambda d: dict(d, images={str(i['id']): i for i in d['images']}), 'string indices|indices must be'),
], ids=['annotation_without_bbox', 'images_as_object'])
def test_annotation_entries_of_another_shape_name_the_file(tmp_path, ann, content, problem):
    """Instead of a bare KeyError: 'bbox' (mmdet's parser) or TypeError (pycocotools' index)."""
    bad = tmp_path / 'bad_schema.json'
    bad.write_text(json.dumps(content(json.loads(open(ann).read()))))
    with pytest.raises(ValueError, match=rf'{bad}: the annotation file does not follow the COCO schema \(.*'
                                         rf'({problem})'):
        build(bad)


def test_empty_after_filtering(tmp_path, ann):
    data = json.loads(open(ann).read())
    data['annotations'] = []
    empty = tmp_path / 'no_objects.json'
    empty.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r'no image is left after filtering \(6 images loaded.*filter_empty_gt'):
        build(empty)
    assert len(build(empty, filter_empty_gt=False)) == 6


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match='nope.json'):
        build(tmp_path / 'nope.json')
