"""The per-direction launch check (tests/_launches.py) itself: a forward that ran another path fails it although
the backward launched its kernels (a whole-run count of launches passed), and so does a backward that ran
another path, or a forward that launched backward kernels."""
import pytest

from _launches import Directions
from timm_lambda.layers.position_lambda import tiled_triton


def _launch(*names):
    for name in names:
        tiled_triton.KERNELS[name] += 1


@pytest.mark.parametrize('stride', [1, 2])
def test_each_direction_must_launch_its_own_kernels(stride, monkeypatch):
    monkeypatch.setattr(tiled_triton, 'KERNELS', type(tiled_triton.KERNELS)())
    backward = ('_tc_rows+logit_grad', '_tc_value_grad')

    d = Directions()
    _launch('_tc_rows')
    d.forward_done()
    _launch(*backward)
    launched = d.check('triton_tc', stride)
    assert launched['forward'] == {'_tc_rows': 1} and set(launched['backward']) == set(backward)

    d = Directions()  # the forward fell back (the GEMM path): the backward's launches do not hide it
    d.forward_done()
    _launch(*backward)
    with pytest.raises(AssertionError, match=rf"stride {stride}: the forward did not launch \['_tc_rows'\]"):
        d.check('triton_tc', stride)

    d = Directions()  # the backward fell back
    _launch('_tc_rows')
    d.forward_done()
    _launch('_tc_rows+logit_grad')
    with pytest.raises(AssertionError, match=r"the backward did not launch \['_tc_value_grad'\]"):
        d.check('triton_tc', stride)

    d = Directions()
    _launch('_query_rows', '_value_grad')
    d.forward_done()
    _launch('_query_rows+logit_grad', '_value_grad')
    with pytest.raises(AssertionError, match='the forward launched backward kernels'):
        d.check('triton_fma', stride)


def test_launches_are_counted_by_kernel_and_variant(monkeypatch):
    """``tiled_triton._launch`` counts each launch that returned under its kernel's name (the rows kernel's
    logit-gradient variant apart); one that raised is not counted."""
    monkeypatch.setattr(tiled_triton, 'KERNELS', type(tiled_triton.KERNELS)())
    monkeypatch.setattr(tiled_triton, '_LAUNCHED', True)

    class Kernel:  # as a Triton function: kernel[grid](*args, **meta), the Python function as ``fn``
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return self.fn

    def _tc_rows(*args, **meta):
        return None

    tiled_triton._launch(Kernel(_tc_rows), (1,), LOGIT_GRAD=False)
    tiled_triton._launch(Kernel(_tc_rows), (1,), LOGIT_GRAD=True)
    assert tiled_triton.KERNELS == {'_tc_rows': 1, '_tc_rows+logit_grad': 1}
