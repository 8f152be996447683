"""Caches keyed by input sizes are bounded in bytes, not only in entries (timm_lambda/layers/size_cache.py;
docs/execution_modes.md, "Caches keyed by input size"): a process that meets many input sizes does not grow with
each."""
import torch

from timm_lambda.layers import relative_embedding as RE
from timm_lambda.layers.size_cache import SizeCache, nbytes


def test_a_size_cache_keeps_the_most_recent_values_that_fit_its_bytes():
    cache = SizeCache(max_bytes=1000, max_entries=3)
    made = []

    def make(n):
        def build():
            made.append(n)
            return torch.zeros(n, dtype=torch.int64)  # 8 n bytes
        return build
    assert cache.get('a', make(50)).numel() == 50 and cache.nbytes == 400
    cache.get('b', make(50))
    assert cache.get('a', make(50)).numel() == 50 and made == [50, 50]  # a hit: not built again
    cache.get('c', make(50))  # 1200 bytes: the least recently used ('b') goes
    assert 'b' not in cache and 'a' in cache and 'c' in cache and cache.nbytes == 800
    cache.get('big', make(200))  # 1600 bytes alone: served, never kept
    assert 'big' not in cache and cache.nbytes == 800
    for key in 'defg':
        cache.get(key, make(1))
    assert len(cache) == 3 and cache.nbytes <= 1000  # and at most max_entries
    assert nbytes(torch.zeros(3, 5)[:, :2]) == 60  # a view holds its whole storage


def test_the_dense_index_cache_stays_within_its_bytes_however_many_sizes():
    """The dense form's index cache (up to 32 MiB an entry at 45x45): 30 input sizes near that bound leave it at
    most 64 MiB (an lru_cache of 16 entries held up to 16 x 32 MiB); the embeddings equal an index built per call."""
    cache = RE.DENSE_INDEX_CACHE
    cache.clear()
    table = torch.randn(1, 1, 3, 3)
    with torch.no_grad():
        for i in range(30):
            h, w = 45 - i % 6, 45 - i // 6
            got = RE.dense_embedding_cached(table, h, w, True)
            assert cache.nbytes <= 64 << 20 and len(cache) <= 16, (h, w, cache.nbytes)
            if i % 10 == 0:
                assert torch.equal(got, RE.dense_embedding(table, h, w, True))
    assert cache.nbytes > 32 << 20  # it does keep what fits
    cache.clear()


def test_index_cache_serves_training_after_inference_mode_and_skips_large_inputs():
    """An index built under inference mode can be saved for backward by a later training step; an input above
    45x45 is never kept."""
    cache = RE.DENSE_INDEX_CACHE
    cache.clear()
    table = torch.randn(2, 1, 5, 5)
    with torch.inference_mode():
        for size in range(1, 20):
            want = RE.dense_embedding(table, size, 3, True)
            assert torch.equal(RE.dense_embedding_cached(table, size, 3, True), want)
        hits = cache.hits
        RE.dense_embedding_cached(table, 19, 3, True)
        assert cache.hits == hits + 1
    assert not RE._dense_index_cached(19, 3, 5, 5, True, table.device).is_inference()
    before = (cache.misses, len(cache))
    RE.dense_embedding_cached(table, 60, 70, True)  # 17.6M entries: not kept
    assert (cache.misses, len(cache)) == before
    cache.clear()


def test_tiled_triton_launch_constant_caches_are_bounded():
    """The tensor-core launch constants, cached per shape (a few hundred bytes each): at most SIZE_CACHE entries
    however many input sizes a process meets."""
    from timm_lambda.layers.position_lambda import tiled_triton as T
    for f in (T._tc_row_tiles, T._tc_value_tiles, T._tc_launch_meta):
        assert f.cache_info().maxsize == T.SIZE_CACHE
    for side in range(1, T.SIZE_CACHE + 40):
        T.tc_launch_meta(4, 16, 64, side, side, 23, 1, torch.float32, side, 'ieee')
    assert T._tc_launch_meta.cache_info().currsize <= T.SIZE_CACHE


def test_the_stride_two_counts_cache_stays_within_its_bytes():
    """The stride-2 windows' in-image counts (position_lambda/fused.py): 40 sizes leave at most 32 entries and 8 MiB;
    each equals a count built per call."""
    from timm_lambda.layers.position_lambda import fused
    cache = fused.IN_IMAGE_COUNTS
    cache.clear()
    like = torch.zeros(1)
    for i in range(40):
        got = fused.in_image_counts(40 + i, 7 + i, like)
        assert torch.equal(got, fused._count_in_image(40 + i, 7 + i, like.device, like.dtype))
    assert len(cache) <= 32 and cache.nbytes <= 8 << 20
