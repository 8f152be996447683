"""A generated image-classification set: one shape or texture per class, drawn in random colours, sizes and
places, deterministic for a seed.

Each image is rendered on demand from its own random stream (``seed``, split, index), so a split is the
same whatever the access order, the number of workers or the other split's size, and nothing is stored.
The dataset behaves like timm's ``ImageDataset``: it returns ``(PIL image, class index)`` and has a
``transform`` attribute, which :func:`timm.data.create_loader` sets to timm's transforms.
"""
import math
from typing import Callable, Optional, Sequence

import numpy as np
from PIL import Image, ImageDraw
from torch.utils.data import Dataset

__all__ = ['SyntheticShapes', 'SHAPE_CLASSES']

# Shapes (outlines differ) and textures (periodic patterns differ); all symmetric under horizontal flips.
SHAPE_CLASSES = ('disc', 'h_stripes', 'triangle', 'checker', 'square', 'v_stripes', 'plus', 'ring')
_SPLITS = {'train': 0, 'val': 1, 'test': 2}
_SUPERSAMPLE = 4  # drawn at 4x and box-filtered down: anti-aliased edges


class SyntheticShapes(Dataset):
    """``num_samples`` images of ``image_size`` x ``image_size`` pixels, classes cycling through ``classes``.

    Args:
        num_samples: images in this split (>= 1).
        image_size: side in pixels (8 .. 1024).
        classes: class names, a subset of :data:`SHAPE_CLASSES` (default: all 8; chance = 1 / len(classes)).
        split: 'train', 'val' or 'test': independent random streams for the same ``seed``.
        seed: base seed (int >= 0).
        noise: standard deviation of the per-pixel Gaussian noise, in 0..255 units (>= 0).
        transform: applied to the PIL image (timm's ``create_loader`` sets it).
        cache: keep rendered images in memory (``image_size**2 x 3`` bytes each) for later epochs.

    Each image: a random background colour, a foreground colour at least 120 away in L1 (RGB), the class's
    shape or a patch of its texture with random size, position (fully inside), rotation for the polygons,
    stripe period/phase, then noise.
    """

    def __init__(self, num_samples: int, image_size: int = 32, classes: Sequence[str] = SHAPE_CLASSES,
                 split: str = 'train', seed: int = 0, noise: float = 12.0, transform: Optional[Callable] = None,
                 cache: bool = False):
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f'num_samples must be an int >= 1, got {num_samples!r}')
        if isinstance(image_size, bool) or not isinstance(image_size, int) or not 8 <= image_size <= 1024:
            raise ValueError(f'image_size must be an int in 8..1024, got {image_size!r}')
        classes = tuple(classes)
        unknown = [c for c in classes if c not in SHAPE_CLASSES]
        if len(classes) < 2 or unknown or len(set(classes)) != len(classes):
            raise ValueError(f'classes must be 2 or more distinct names from {SHAPE_CLASSES}, got {classes!r}')
        if split not in _SPLITS:
            raise ValueError(f'split must be one of {tuple(_SPLITS)}, got {split!r}')
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f'seed must be an int >= 0, got {seed!r}')
        if not isinstance(noise, (int, float)) or isinstance(noise, bool) or not noise >= 0:
            raise ValueError(f'noise must be a number >= 0, got {noise!r}')
        self.num_samples, self.image_size, self.classes = num_samples, image_size, classes
        self.split, self.seed, self.noise, self.transform = split, seed, float(noise), transform
        self._cache = {} if cache else None

    def __len__(self) -> int:
        return self.num_samples

    def target(self, index: int) -> int:
        return index % len(self.classes)

    def __getitem__(self, index: int):
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f'index {index} out of range for {self.num_samples} samples')
        index %= self.num_samples
        target = self.target(index)
        if self._cache is None:
            img = self.render(index)
        else:
            img = self._cache.get(index)
            if img is None:
                img = self._cache[index] = self.render(index)
        if self.transform is not None:
            img = self.transform(img)
        return img, target

    def render(self, index: int) -> Image.Image:
        """The image at ``index`` (no transform), from the random stream (seed, split, index)."""
        rng = np.random.default_rng([self.seed, _SPLITS[self.split], index])
        name = self.classes[self.target(index)]
        s = self.image_size * _SUPERSAMPLE
        bg = rng.integers(0, 256, 3)
        while True:
            fg = rng.integers(0, 256, 3)
            if np.abs(fg - bg).sum() >= 120:
                break
        canvas = Image.new('RGB', (s, s), tuple(int(c) for c in bg))
        draw = ImageDraw.Draw(canvas)
        fill = tuple(int(c) for c in fg)
        # half-size r in [0.22, 0.4] of the image, centre anywhere that keeps the figure inside
        r = rng.uniform(0.22, 0.40) * s
        cx, cy = rng.uniform(r, s - r, 2)
        if name == 'disc':
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        elif name == 'ring':
            w = rng.uniform(0.25, 0.4) * r
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
            draw.ellipse([cx - r + w, cy - r + w, cx + r - w, cy + r - w], fill=tuple(int(c) for c in bg))
        elif name in ('square', 'triangle'):
            sides = 4 if name == 'square' else 3
            angle = rng.uniform(0, 2 * math.pi)
            draw.polygon([(cx + r * math.cos(angle + 2 * math.pi * i / sides),
                           cy + r * math.sin(angle + 2 * math.pi * i / sides)) for i in range(sides)], fill=fill)
        elif name == 'plus':
            w = rng.uniform(0.25, 0.4) * r
            draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
            draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)
        else:  # a square patch of side 2r of the texture: stripes (half a period wide) or a checkerboard
            period = rng.uniform(0.12, 0.22) * s
            phase = rng.uniform(0, period, 2)
            yy, xx = np.mgrid[0:s, 0:s] + 0.5
            inside = (np.abs(xx - cx) < r) & (np.abs(yy - cy) < r)
            ty, tx = np.floor((yy + phase[0]) / (period / 2)), np.floor((xx + phase[1]) / (period / 2))
            on = {'h_stripes': ty % 2 == 0, 'v_stripes': tx % 2 == 0, 'checker': (ty + tx) % 2 == 0}[name]
            arr = np.asarray(canvas).copy()
            arr[inside & on] = fg
            canvas = Image.fromarray(arr)
        img = canvas.resize((self.image_size, self.image_size), Image.BOX)
        if self.noise:
            arr = np.asarray(img, dtype=np.float32) + rng.normal(0, self.noise, (self.image_size, self.image_size, 3))
            img = Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8))
        return img
