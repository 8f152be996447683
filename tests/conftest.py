"""Shared pytest configuration for timm-lambda.

Keep this minimal: shared fixtures and test-run plumbing only.  Install/packaging checks live in
tests/test_install.py.

The suite runs on every core with pytest-xdist (``-n auto --dist loadgroup`` in pyproject.toml): each worker gets
its share of the cores as torch threads (and as ``OMP_NUM_THREADS`` for the subprocesses it starts), and the
longest tests are started first so that no worker is left running one of them at the end.
"""
import importlib.metadata as _md
import os
import sys

import pytest

# Strict mode for every test and the processes it starts: a position-lambda backend that fails raises instead of
# handing the call to the next backend, whose correct answer would hide the failure (timm_lambda's backends.py).
os.environ['TIMM_LAMBDA_STRICT'] = '1'

# The longest tests of a CI run (its --durations list), longest first: each starts as soon as a worker is free.
LONGEST_FIRST = (
    'test_compiled_blocks_train_like_eager',
    'test_quickstart_default_run',
    'test_shortened_quick_run_beats_chance_clearly',
    'test_aoti_package_of_a_lambdaresnet_equals_eager_at_multiples_of_32',
    'test_aoti_package_of_one_export_equals_eager_at_every_size',
    'test_two_builds_at_once_then_a_half_written_library_and_a_stale_lock',
    'test_gpu_check_mission_dry_run',
    'test_compiled_training_at_a_second_size_equals_eager',
    'test_tensor_core_kernels_interpreted_round_as_they_claim',
    'test_cuda_core_kernels_interpreted_equal_the_reference_in_float64',
)


@pytest.fixture
def backend():
    """``backend(name, strict=None)`` runs the position lambdas by ``name`` (or ``'auto'``) through the public
    override, ``timm_lambda.layers.set_backend``, for one test; the choice before it is restored after."""
    from timm_lambda.layers.position_lambda import backends
    before, strict = backends.get_backend(), backends.is_strict()
    yield backends.set_backend
    backends.set_backend(before, strict)


def pytest_report_header(config):
    """Show the versions the tests run against (no heavy imports here)."""
    parts = []
    for dist in ("timm-lambda", "torch", "torchvision", "timm", "mmcv", "mmengine", "mmdet"):
        try:
            parts.append(f"{dist} {_md.version(dist)}")
        except _md.PackageNotFoundError:
            parts.append(f"{dist} (not installed)")
    return [f"python: {sys.executable}", "versions: " + ", ".join(parts), _native_bf16_line()]


def _native_bf16_line() -> str:
    """Whether this run tests the CPU kernel's native bfloat16 code (built and run only on a CPU with AVX-512 BF16;
    elsewhere those tests skip and a bfloat16 call computes in float32): said plainly in every run's header, CI's
    machines differing in CPU."""
    flags = ''
    if os.path.exists('/proc/cpuinfo'):
        with open('/proc/cpuinfo') as f:
            flags = next((line for line in f if line.startswith(('flags', 'Features'))), '')
    if 'avx512_bf16' in flags.split():
        return 'CPU kernel native bfloat16 (AVX-512 BF16): tested on this machine'
    return ('CPU kernel native bfloat16 (AVX-512 BF16): NOT tested on this machine (its CPU lacks AVX-512 BF16; '
            'those tests skip, the float32-computed bfloat16 path is tested)')


def pytest_addoption(parser):
    parser.addoption('--heavy', action='store_true',
                     help='also run the tests marked heavy (the model-level torch.compile flows of timm\'s train.py '
                          'and mmengine: about 10 minutes of one core, cold inductor cache); CI does not')


def keep_builtin_ops_alive():
    """Work around a torch bug that made timm's TorchScript tests fail now and then in CI ("builtin cannot be used as
    a value" at ``Conv2d._conv_forward``'s ``self._reversed_padding_repeated_twice``). TorchScript resolves a module
    attribute to a builtin op by ``id()`` (``torch.jit._builtins._builtin_table``) without holding the op objects it
    registers. When an op gets a new overload its packet is refreshed and the old op object freed (``torch.compile``
    registers ``quantized_decomposed``'s overloads in steps), while its id stays in the table; a 4-tuple allocated at
    that address later (a Conv2d's padding) is then taken for that op. Holding every registered object keeps its
    address taken (tests/test_execution_modes.py::test_torchscript_never_takes_a_tuple_for_a_freed_builtin)."""
    from torch.jit import _builtins
    register = _builtins._register_builtin
    if getattr(register, 'keeps_alive', False):
        return
    kept = []

    def register_and_keep(fn, op):
        kept.append(fn)
        register(fn, op)

    register_and_keep.keeps_alive = True
    _builtins._register_builtin = register_and_keep  # torch/_ops.py looks it up at every call


def pytest_configure(config):
    """Under pytest-xdist, share the cores among the workers instead of each worker using all of them."""
    keep_builtin_ops_alive()
    workers = os.environ.get('PYTEST_XDIST_WORKER_COUNT')
    if workers:
        threads = str(max(1, len(os.sched_getaffinity(0)) // int(workers)))
        for var in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS'):
            os.environ[var] = threads  # read by the subprocesses the tests start (mmdet's tools, torchrun, ...)
        import torch
        torch.set_num_threads(int(threads))


def pytest_collection_modifyitems(config, items):
    """tests/test_timm_suite.py imports timm's whole model test matrix: keep our models' items only, less the
    deepest models (as timm's CI) and the FX and TorchScript tests beyond one member of each depth family
    (tests/_timm_suite_filters.py). Tests marked ``heavy`` run only with ``--heavy`` or ``-m heavy``. Then order
    (a stable sort): the modules of the longest tests first, each starting with its longest test, then the other
    modules with slow tests, the modules of unit tests last."""
    from _timm_suite_filters import excluded
    from timm_lambda import registered_models
    ours = set(registered_models())
    keep, drop = [], []
    for item in items:
        if item.module.__name__ == 'test_timm_suite' and item.name != 'test_timm_suite_available':
            callspec = getattr(item, 'callspec', None)
            name = callspec.params.get('model_name') if callspec else None
            if not name or name.split('.')[0] not in ours or excluded(item.originalname, name.split('.')[0]):
                drop.append(item)
                continue
            item.add_marker('timm_suite')
            item.add_marker('slow')
        elif item.get_closest_marker('heavy') and not (config.getoption('heavy')
                                                        or 'heavy' in (config.getoption('markexpr') or '')):
            drop.append(item)  # outside CI: run with --heavy or -m heavy
            continue
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)

    # Whole modules move (a module-scoped fixture is set up once when its module's tests run together).
    def rank(item):
        if item.originalname in LONGEST_FIRST:
            return LONGEST_FIRST.index(item.originalname)
        return len(LONGEST_FIRST) + (0 if item.get_closest_marker('slow') else 1)

    module_rank = {}
    for item in keep:
        module_rank[item.module] = min(module_rank.get(item.module, len(LONGEST_FIRST) + 1), rank(item))
    items[:] = sorted(keep, key=lambda item: (module_rank[item.module], min(rank(item), len(LONGEST_FIRST))))
