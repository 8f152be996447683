"""COCO dataset that reports problems with its files by name instead of failing deep inside mmengine."""
import json
import os.path as osp
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
    * ``metainfo.classes`` of which no name is a category of the file (``ValueError`` listing both); names
      that match no category give a warning;
    * no image left after ``filter_cfg`` (``ValueError`` with the image count before filtering and the
      filter settings), instead of "need at least one array to concatenate" from a sampler.
    """

    @property
    def coco(self):
        return self._coco

    @coco.setter
    def coco(self, value):  # mmdet's load_data_list sets self.coco, reads it, then deletes it
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
        classes = tuple(self.metainfo.get('classes', ()))
        names = self._category_names
        unmatched = [c for c in classes if c not in names]
        if classes and not self.cat_ids:
            raise ValueError(f'{path}: none of metainfo.classes {list(classes)} is a category of the annotation '
                             f'file (its categories: {names[:20]}{" ..." if len(names) > 20 else ""})')
        if unmatched:
            warnings.warn(f'{path}: metainfo.classes {unmatched} match no category of the annotation file')
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
