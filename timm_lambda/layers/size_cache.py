"""Caches keyed by input sizes, bounded in bytes as well as in entries.

An ``lru_cache`` bounds the number of entries only: one whose values grow with the input (a dense gather index holds
``(H W)^2`` entries) grows a process that meets many sizes by up to ``maxsize`` times its largest value. A
:class:`SizeCache` keeps the most recently used values while their bytes fit ``max_bytes`` (and at most
``max_entries`` of them), drops the least recently used beyond that, and never keeps a value larger than
``max_bytes``. The bounds of this package's caches: docs/execution_modes.md, "Caches keyed by input size".
"""
import collections
import threading
from typing import Callable, Hashable

import torch

__all__ = ['SizeCache', 'nbytes']


def nbytes(value) -> int:
    """Bytes a cached value holds: a tensor's storage (its elements where it has none), a numpy array's buffer."""
    if isinstance(value, torch.Tensor):
        try:
            return value.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # no storage (a tensor subclass, a fake tensor)
            return value.numel() * value.element_size()
    return int(getattr(value, 'nbytes', 0))


class SizeCache:
    """A least-recently-used cache bounded in bytes (:func:`nbytes` of its values) and in entries; thread safe."""

    def __init__(self, max_bytes: int, max_entries: int = 64):
        self.max_bytes, self.max_entries = int(max_bytes), int(max_entries)
        self._values: 'collections.OrderedDict[Hashable, object]' = collections.OrderedDict()
        self._sizes = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Hashable, make: Callable[[], object]):
        """The value cached for ``key``, or ``make()``, kept if it fits (evicting the least recently used)."""
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                self.hits += 1
                return self._values[key]
            self.misses += 1
        value = make()
        size = nbytes(value)
        if size > self.max_bytes or self.max_entries < 1:
            return value
        with self._lock:
            if key not in self._values:
                self._values[key], self._sizes[key] = value, size
                self._bytes += size
            while self._bytes > self.max_bytes or len(self._values) > self.max_entries:
                old, _ = self._values.popitem(last=False)
                self._bytes -= self._sizes.pop(old)
        return value

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key) -> bool:
        return key in self._values

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self._sizes.clear()
            self._bytes = 0
