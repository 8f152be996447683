"""Which Triton kernels each direction of a call launched (``tiled_triton.KERNELS``), checked per direction and
stride: a forward or a backward that fell back to another path (the GEMM path inside ``triton_tc``, another
backend) launches none of its kernels and fails, whatever the other direction launched. Shared by the interpreted
run (tests/_triton_interpreted.py) and the GPU tests (tests/test_cuda.py)."""
import collections

from timm_lambda.layers.position_lambda import tiled_triton

# the kernels each backend's forward and backward launch at every stride ('+logit_grad': the rows kernel's
# logit-gradient variant); other kernels may launch beside them, but no backward kernel in a forward
EXPECTED = {
    'triton_tc': {'forward': {'_tc_rows'}, 'backward': {'_tc_rows+logit_grad', '_tc_value_grad'}},
    'triton_fma': {'forward': {'_query_rows'}, 'backward': {'_query_rows+logit_grad', '_value_grad'}},
}


class Directions:
    """Counts of the kernels launched since it was made: :meth:`forward_done` after the forward, then
    :meth:`check` after the backward."""

    def __init__(self):
        self.start = collections.Counter(tiled_triton.KERNELS)
        self.forward = self.middle = None

    def forward_done(self):
        self.forward = collections.Counter(tiled_triton.KERNELS) - self.start
        self.middle = collections.Counter(tiled_triton.KERNELS)

    def check(self, backend: str, stride: int, label: str = '', backward: bool = True):
        """Assert that the forward (and the backward) launched ``backend``'s kernels; returns both counts."""
        assert self.forward is not None, 'forward_done() was not called'
        launched = dict(forward=self.forward, backward=collections.Counter(tiled_triton.KERNELS) - self.middle)
        expected = EXPECTED[backend]
        for direction in ('forward', 'backward') if backward else ('forward',):
            missing = expected[direction] - set(launched[direction])
            assert not missing, (f'{label} stride {stride}: the {direction} did not launch {sorted(missing)} '
                                 f'(launched {dict(launched[direction])}): it ran another path')
        wrong = expected['backward'] & set(launched['forward'])
        assert not wrong, f'{label} stride {stride}: the forward launched backward kernels {sorted(wrong)}'
        return launched
