"""Which Triton kernels each direction of a call launched, observed through Triton's own launch hooks
(``add_pre_run_hook`` on the kernels of ``tiled_triton.kernels()``): a forward or a backward that fell back to another
path (the GEMM path inside ``triton_tc``, another backend) launches none of its kernels and fails, whatever the other
direction launched. Shared by the interpreted run (tests/_triton_interpreted.py) and the GPU tests
(tests/test_cuda.py). The product keeps no counters: this module is the only record."""
import collections

from timm_lambda.layers.position_lambda import tiled_triton

# the kernels each backend's forward and backward launch at every stride ('+logit_grad': the rows kernel's
# logit-gradient variant); other kernels may launch beside them, but no backward kernel in a forward
EXPECTED = {
    'triton_tc': {'forward': {'_tc_rows'}, 'backward': {'_tc_rows+logit_grad', '_tc_value_grad'}},
    'triton_fma': {'forward': {'_query_rows'}, 'backward': {'_query_rows+logit_grad', '_value_grad'}},
}

LAUNCHES: 'collections.Counter[str]' = collections.Counter()  # every launch of this process, by kernel and variant
METAS: list = []  # each launch's (name, keyword arguments: the constants), in order; clear it where you read it
_HOOKED = set()


def hook_kernels() -> None:
    """Record every launch of the Triton kernels in :data:`LAUNCHES` and :data:`METAS` (once a process)."""
    kernels = tiled_triton.kernels()
    for key in ('query_rows', 'value_grad', 'tc_rows', 'tc_value_grad'):
        kernel = kernels[key]
        if id(kernel) in _HOOKED:
            continue
        _HOOKED.add(id(kernel))
        name = '_' + key
        arg_names = list(getattr(kernel, 'arg_names', []))

        def hook(*args, _name=name, _names=arg_names, **kwargs):
            meta = dict(zip(_names, args), **kwargs)  # (every argument by its name: STEP, FUSED, the tiles)
            full = _name + ('+logit_grad' if meta.get('LOGIT_GRAD') else '')
            LAUNCHES[full] += 1
            METAS.append((full, meta))
        kernel.add_pre_run_hook(hook)


def launched() -> int:
    """Launches recorded so far in this process."""
    return sum(LAUNCHES.values())


class Directions:
    """Counts of the kernels launched since it was made: :meth:`forward_done` after the forward, then
    :meth:`check` after the backward."""

    def __init__(self):
        hook_kernels()
        self.start = collections.Counter(LAUNCHES)
        self.forward = self.middle = None

    def forward_done(self):
        self.forward = collections.Counter(LAUNCHES) - self.start
        self.middle = collections.Counter(LAUNCHES)

    def check(self, backend: str, stride: int, label: str = '', backward: bool = True, chunks: dict = None):
        """Assert that the forward (and the backward) launched ``backend``'s kernels, each at least
        ``chunks[direction]`` times (the chunks of images a direction's wrappers launch one by one: a chunk that ran
        another path leaves its kernels short); returns both counts."""
        assert self.forward is not None, 'forward_done() was not called'
        launched = dict(forward=self.forward, backward=collections.Counter(LAUNCHES) - self.middle)
        expected = EXPECTED[backend]
        for direction in ('forward', 'backward') if backward else ('forward',):
            missing = expected[direction] - set(launched[direction])
            assert not missing, (f'{label} stride {stride}: the {direction} did not launch {sorted(missing)} '
                                 f'(launched {dict(launched[direction])}): it ran another path')
            need = (chunks or {}).get(direction, 1)
            short = {k: launched[direction][k] for k in expected[direction] if launched[direction][k] < need}
            assert not short, (f'{label} stride {stride}: the {direction} launched {short} for {need} chunks: a '
                               'chunk ran another path')
        wrong = expected['backward'] & set(launched['forward'])
        assert not wrong, f'{label} stride {stride}: the forward launched backward kernels {sorted(wrong)}'
        return launched
