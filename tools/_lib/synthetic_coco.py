"""Generate a small, deterministic COCO-format instance-segmentation dataset (the quick start's built-in data).

The dataset exercises the parts of the COCO format that detection code tends
to get wrong:

* several categories (``square``, ``circle``, ``triangle``, ``star``), every
  object annotated with a **polygon** mask;
* **crowd** annotations (``iscrowd=1``) stored as uncompressed RLE, like the
  real COCO crowd regions (mmdet turns them into ignore regions);
* images with **no objects** at all;
* optionally image sizes that are **not divisible by 32**.

Layout written under ``--out`` (the same as ``data/coco`` in mmdet configs)::

    <out>/train/000000.jpg ...
    <out>/val/000000.jpg ...
    <out>/annotations/instances_train.json
    <out>/annotations/instances_val.json

The output only depends on the arguments (``--seed`` included): running it
twice gives byte-identical annotation files.

Command line: ``python tools/make_coco_dataset.py --out data/synthetic_coco --seed 0``.
"""
import json
import os
import os.path as osp

import cv2
import numpy as np

__all__ = ['make_coco_dataset', 'make_split', 'CATEGORIES']

CATEGORIES = [
    dict(id=1, name='square', supercategory='shape'),
    dict(id=2, name='circle', supercategory='shape'),
    dict(id=3, name='triangle', supercategory='shape'),
    dict(id=4, name='star', supercategory='shape'),
]

# Distinct colours per class make the task learnable within a few hundred
# iterations, while the random background texture keeps it non-trivial.
_CLASS_COLOURS = {
    1: (40, 40, 220),
    2: (40, 200, 40),
    3: (220, 60, 40),
    4: (30, 200, 220),
}


def _polygon(cat_id, cx, cy, r, angle):
    """Vertices (N, 2) float of the outline of one shape."""
    if cat_id == 1:  # square
        ts = angle + np.arange(4) * np.pi / 2 + np.pi / 4
        radii = np.full(4, r)
    elif cat_id == 2:  # circle (24-gon)
        ts = angle + np.arange(24) * 2 * np.pi / 24
        radii = np.full(24, r)
    elif cat_id == 3:  # triangle
        ts = angle + np.arange(3) * 2 * np.pi / 3
        radii = np.full(3, r)
    else:  # five-pointed star
        ts = angle + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, r, r * 0.45)
    xs = cx + radii * np.cos(ts)
    ys = cy + radii * np.sin(ts)
    return np.stack([xs, ys], axis=1)


def _rle_uncompressed(mask):
    """COCO uncompressed RLE (column-major run lengths, starting with 0s)."""
    flat = np.asarray(mask, dtype=np.uint8).flatten(order='F')
    counts = []
    prev = 0
    run = 0
    for v in flat:
        if v != prev:
            counts.append(run)
            run = 0
            prev = v
        run += 1
    counts.append(run)
    return dict(counts=[int(c) for c in counts], size=list(mask.shape))


def _polygon_area(poly):
    x, y = poly[:, 0], poly[:, 1]
    return float(0.5 * abs(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1))))


def _make_image(rng, width, height, with_objects, with_crowd, ann_id_start,
                image_id):
    """Draw one image; returns (BGR uint8 image, list of annotations)."""
    base = rng.integers(90, 170, size=3)
    noise = rng.integers(-25, 26, size=(height, width, 3))
    img = np.clip(base[None, None, :] + noise, 0, 255).astype(np.uint8)
    anns = []
    ann_id = ann_id_start
    if with_objects:
        n_obj = int(rng.integers(1, 5))
        min_side = min(width, height)
        for _ in range(n_obj):
            cat_id = int(rng.integers(1, len(CATEGORIES) + 1))
            r = float(rng.uniform(0.08, 0.22) * min_side)
            cx = float(rng.uniform(r, width - r))
            cy = float(rng.uniform(r, height - r))
            poly = _polygon(cat_id, cx, cy, r, float(rng.uniform(0, 2 * np.pi)))
            poly[:, 0] = np.clip(poly[:, 0], 0, width - 1)
            poly[:, 1] = np.clip(poly[:, 1], 0, height - 1)
            cv2.fillPoly(img, [np.round(poly).astype(np.int32)],
                         _CLASS_COLOURS[cat_id], lineType=cv2.LINE_8)
            x0, y0 = poly.min(axis=0)
            x1, y1 = poly.max(axis=0)
            anns.append(
                dict(
                    id=ann_id,
                    image_id=image_id,
                    category_id=cat_id,
                    segmentation=[[round(float(v), 2) for v in poly.flatten()]],
                    area=round(_polygon_area(poly), 2),
                    bbox=[round(float(x0), 2), round(float(y0), 2),
                          round(float(x1 - x0), 2), round(float(y1 - y0), 2)],
                    iscrowd=0))
            ann_id += 1
    if with_crowd:
        # A crowd: a cluster of small objects of one class annotated as a
        # single iscrowd=1 RLE region (as in real COCO).
        cat_id = int(rng.integers(1, len(CATEGORIES) + 1))
        mask = np.zeros((height, width), np.uint8)
        gx = float(rng.uniform(0.2, 0.8) * width)
        gy = float(rng.uniform(0.2, 0.8) * height)
        rr = 0.04 * min(width, height) + 1
        for _ in range(6):
            cx = float(np.clip(gx + rng.normal(0, 3 * rr), rr, width - rr))
            cy = float(np.clip(gy + rng.normal(0, 3 * rr), rr, height - rr))
            poly = _polygon(cat_id, cx, cy, rr, float(rng.uniform(0, 6.3)))
            pts = np.round(poly).astype(np.int32)
            cv2.fillPoly(img, [pts], _CLASS_COLOURS[cat_id])
            cv2.fillPoly(mask, [pts], 1)
        ys, xs = np.nonzero(mask)
        x0, y0, x1, y1 = xs.min(), ys.min(), xs.max() + 1, ys.max() + 1
        anns.append(
            dict(
                id=ann_id,
                image_id=image_id,
                category_id=cat_id,
                segmentation=_rle_uncompressed(mask),
                area=float(mask.sum()),
                bbox=[float(x0), float(y0), float(x1 - x0), float(y1 - y0)],
                iscrowd=1))
    return img, anns


def make_split(out_dir, split, num_images, image_size, seed,
               empty_every=5, crowd_every=4, odd_sizes=True):
    """Write one split; returns the path of its annotation file."""
    if num_images < 1:
        raise ValueError(f'num_images must be >= 1, got {num_images}')
    if image_size < 64:
        raise ValueError(f'image_size must be >= 64 pixels, got {image_size}')
    # Separate, seed-derived generators per split keep splits independent.
    rng = np.random.default_rng([seed, 0 if split == 'train' else 1])
    img_dir = osp.join(out_dir, split)
    ann_dir = osp.join(out_dir, 'annotations')
    os.makedirs(img_dir, exist_ok=True)
    os.makedirs(ann_dir, exist_ok=True)
    images, annotations = [], []
    ann_id = 1
    for i in range(num_images):
        if odd_sizes:
            # Sizes in [0.75, 1.0] * image_size; most are not multiples of 32.
            w = int(rng.integers(int(image_size * 0.75), image_size + 1))
            h = int(rng.integers(int(image_size * 0.75), image_size + 1))
        else:
            w = h = image_size
        image_id = i + 1
        with_objects = not (empty_every and i % empty_every == empty_every - 1)
        with_crowd = bool(with_objects and crowd_every
                          and i % crowd_every == 1)
        img, anns = _make_image(rng, w, h, with_objects, with_crowd, ann_id,
                                image_id)
        ann_id += len(anns)
        file_name = f'{i:06d}.jpg'
        cv2.imwrite(osp.join(img_dir, file_name), img,
                    [cv2.IMWRITE_JPEG_QUALITY, 95])
        images.append(
            dict(id=image_id, file_name=file_name, width=w, height=h))
        annotations.extend(anns)
    coco = dict(
        info=dict(
            description='timm-lambda synthetic shapes (tools/_lib/synthetic_coco.py)',
            version='1.0',
            year=2021,
            seed=seed),
        licenses=[dict(id=1, name='CC0', url='')],
        images=images,
        annotations=annotations,
        categories=CATEGORIES)
    ann_file = osp.join(ann_dir, f'instances_{split}.json')
    with open(ann_file, 'w') as f:
        json.dump(coco, f)
    return ann_file


def make_coco_dataset(out_dir, num_train=24, num_val=8, image_size=160,
                      seed=0, odd_sizes=True):
    """Generate train and val splits under ``out_dir``.

    Returns a dict with ``train``/``val`` annotation file paths and the
    category names (``classes``) for ``metainfo``.
    """
    return dict(
        train=make_split(out_dir, 'train', num_train, image_size, seed,
                         odd_sizes=odd_sizes),
        val=make_split(out_dir, 'val', num_val, image_size, seed,
                       odd_sizes=odd_sizes),
        classes=tuple(c['name'] for c in CATEGORIES))
