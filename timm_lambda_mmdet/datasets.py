"""COCO dataset that reports problems with its files by name instead of failing deep inside mmengine."""
import difflib
import json
import os.path as osp
import re
import warnings
from typing import List

from mmdet.datasets import CocoDataset
from mmdet.registry import DATASETS

__all__ = ['CheckedCocoDataset']


@DATASETS.register_module()
class CheckedCocoDataset(CocoDataset):
    """mmdet's :class:`~mmdet.datasets.CocoDataset` with checks that name the file and the problem:

    * a missing annotation file (``FileNotFoundError`` with ``data_root`` + ``ann_file``);
    * malformed JSON (``ValueError`` with ``path:line:column`` and the parser's message);
    * JSON that is not a COCO object (a list, ...) or lacks ``images`` / ``categories`` (``ValueError``
      naming the file and what it holds), instead of pycocotools' AssertionError or ``KeyError: 'categories'``;
    * entries of another shape (``images`` as an object, an annotation without ``bbox``): a ``ValueError``
      naming the file and the missing key, instead of a bare ``KeyError`` / ``TypeError``;
    * ``metainfo.classes`` with a name that is no category of the file (``ValueError`` naming the unmatched
      names and the file's categories): a misspelt class would otherwise train silently empty.
      ``allow_missing_classes=True`` accepts such names on purpose (with a warning), e.g. a class absent
      from a subset; a list of which no name matches is always an error;
    * no image left after ``filter_cfg`` (``ValueError`` with the image count before filtering and the
      filter settings), instead of "need at least one array to concatenate" from a sampler.
    """

    def __init__(self, *args, allow_missing_classes: bool = False, **kwargs):
        if not isinstance(allow_missing_classes, bool):
            raise ValueError(f'allow_missing_classes must be True or False, got {allow_missing_classes!r}')
        self.allow_missing_classes = allow_missing_classes  # before super().__init__, which loads the file
        metainfo = kwargs.get('metainfo')
        self._classes_set = args[1:2] != () or (metainfo is not None and 'classes' in metainfo)
        super().__init__(*args, **kwargs)

    @property
    def coco(self):
        return self._coco

    @coco.setter
    def coco(self, value):  # mmdet's load_data_list sets self.coco, reads it, then deletes it
        missing = [k for k in ('images', 'categories') if not isinstance(value.dataset.get(k), list)]
        if missing:
            raise ValueError(f'{self.ann_file}: the annotation file has no list of {" and ".join(missing)} '
                             f'(COCO format: a JSON object with images, annotations and categories; its keys: '
                             f'{sorted(value.dataset)})')
        self._coco = value
        self._category_names = [c['name'] for c in value.cats.values()]

    @coco.deleter
    def coco(self):
        del self._coco

    def load_data_list(self) -> List[dict]:
        path = self.ann_file
        if '://' not in path and not osp.isfile(path):
            raise FileNotFoundError(f"ann_file: annotation file '{path}' does not exist (data_root + ann_file); "
                                    'set dataset.data_root / dataset.ann_file')
        try:
            data_list = super().load_data_list()
        except json.JSONDecodeError as e:
            raise ValueError(f'{path}:{e.lineno}:{e.colno}: malformed JSON in the annotation file: {e.msg}') from None
        except AssertionError as e:  # pycocotools: "annotation file format <class 'list'> not supported"
            if 'annotation file format' not in str(e):
                raise
            found = re.search(r"<class '(\w+)'>", str(e))
            kind = {'list': 'array', 'str': 'string', 'NoneType': 'null'}.get(found[1], found[1]) if found else '?'
            raise ValueError(f'{path}: the annotation file holds a JSON {kind}, not a COCO object (a JSON object '
                             'with images, annotations and categories)') from None
        except (KeyError, TypeError) as e:  # pycocotools' index or mmdet's parser met an entry of another shape
            detail = f'an entry lacks the key {e}' if isinstance(e, KeyError) else str(e)
            raise ValueError(f'{path}: the annotation file does not follow the COCO schema ({detail}): images, '
                             'annotations and categories must be lists of objects, each annotation with '
                             'image_id, category_id and bbox [x, y, w, h]') from e
        classes = tuple(self.metainfo.get('classes', ()))
        names = self._category_names
        unmatched = [c for c in classes if c not in names]
        if classes and not self.cat_ids:
            raise ValueError(f'{path}: none of metainfo.classes {list(classes)} is a category of the annotation '
                             f'file (its categories: {names[:20]}{" ..." if len(names) > 20 else ""})')
        if unmatched:
            close = {c: m for c in unmatched for m in difflib.get_close_matches(c, names, n=1, cutoff=0.6)}
            default = '' if self._classes_set else " (not set: CocoDataset's default, the 80 COCO classes)"
            msg = (f'{path}: metainfo.classes{default} {unmatched} match no category of the annotation file'
                   f'{f" (did you mean {close}?)" if close else ""}; its categories: '
                   f'{names[:100]}{" ..." if len(names) > 100 else ""}')
            if not self.allow_missing_classes:
                raise ValueError(f'{msg}; fix the name, or set allow_missing_classes=True in the dataset config '
                                 'to train without objects of them')
            warnings.warn(msg)
        self._num_loaded = len(data_list)
        return data_list

    def filter_data(self) -> List[dict]:
        kept = super().filter_data()
        if not kept:
            raise ValueError(
                f'{self.ann_file}: no image is left after filtering ({getattr(self, "_num_loaded", "?")} images '
                f'loaded, filter_cfg={self.filter_cfg}, classes={list(self.metainfo.get("classes", ()))}); '
                'check that the annotations hold objects of these classes, or relax filter_cfg')
        return kept

