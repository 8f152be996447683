"""The per-direction launch check (tests/_launches.py) itself: a forward that ran another path fails it although
the backward launched its kernels (a whole-run count of launches passed), and so does a backward that ran
another path, or a forward that launched backward kernels; and the launches it reads are Triton's own (its
``add_pre_run_hook`` on the kernels of ``tiled_triton.kernels()``), by kernel and variant."""
import pytest

import _launches
from _helpers import require_triton
from _launches import Directions


def _launch(*names):
    for name in names:
        _launches.LAUNCHES[name] += 1


@pytest.mark.parametrize('stride', [1, 2])
def test_each_direction_must_launch_its_own_kernels(stride, monkeypatch):
    require_triton()
    monkeypatch.setattr(_launches, 'LAUNCHES', type(_launches.LAUNCHES)())
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


def test_launches_are_seen_through_tritons_hooks_by_kernel_and_variant(monkeypatch):
    """A launch of a kernel of ``tiled_triton.kernels()`` reaches the hooks with its constants: counted under the
    kernel's name, the rows kernel's logit-gradient variant apart; the product keeps no count of its own."""
    require_triton()
    from timm_lambda.layers.position_lambda import tiled_triton
    monkeypatch.setattr(_launches, 'LAUNCHES', type(_launches.LAUNCHES)())
    _launches.hook_kernels()
    rows = tiled_triton.kernels()['tc_rows']
    for hook in rows.pre_run_hooks:
        hook(LOGIT_GRAD=False)
        hook(LOGIT_GRAD=True)
    assert _launches.LAUNCHES == {'_tc_rows': 1, '_tc_rows+logit_grad': 1}
    assert not any(hasattr(tiled_triton, name) for name in ('LAUNCHES', 'KERNELS', 'PREFILL_NAN'))
