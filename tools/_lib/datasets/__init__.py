"""Generated datasets for short runs and tests."""
from .shapes import SHAPE_CLASSES, SyntheticShapes

__all__ = ['SHAPE_CLASSES', 'SyntheticShapes']
