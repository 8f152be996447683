"""One plan a call (timm_lambda/layers/position_lambda/plan.py) and the registry of backend objects (backends.py):
the execution mode read once a call, the backward run by the forward's backend in eager mode and under torch.compile,
a backend added from a test file alone and served in both modes, a backend that fails at run time handed on once, and
everything the backward reads passing through ``save_for_backward`` (activation checkpointing, ``save_on_cpu`` and
any ``saved_tensors_hooks`` see it)."""
import collections
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from timm_lambda.layers import LambdaLayer, execution
from timm_lambda.layers import position_lambda as PL
from timm_lambda.layers.execution import BackendUnusable
from timm_lambda.layers.position_lambda import backends, lambdas_plain, plan


class PlainOpsBackend(PL.Backend):
    """A backend of this test file only: its forward by the public plain-op forms, its backward by the gemm
    backend's (an operator backend runs below autograd: its backward computes gradients without it), its decisions
    the gemm backend's."""
    name = 'test_plain_ops'
    forms = ('tiled', 'dense')
    devices = ('cpu',)
    dtypes = (torch.float64,)

    def decide(self, call):
        return backends.get('gemm').decide(call)

    def forward(self, plan, q, keys, v, table, shared):
        k, u = table.shape[0], table.shape[1]
        b, height, width = q.shape[0], q.shape[2], q.shape[3]
        n = height * width
        y = lambdas_plain(q.reshape(b, q.shape[1] // k, k, n), None if keys is None else keys.reshape(b, u, k, n),
                          v.reshape(b, u, v.shape[1] // u, n), table, shared, height, width, plan.form, plan.stride,
                          plan.count_include_pad, plan.key_norm, plan.global_scope, None)
        return y.contiguous(), None, None  # (nothing kept: the backward recomputes the content lambda)

    def backward(self, plan, gy, q, keys, v, table, shared, content, kn):
        return backends.get('gemm').backward(plan, gy, q, keys, v, table, shared, content, kn)


@pytest.fixture
def test_backend(backend):
    PL.register_backend(PlainOpsBackend(), before='cpu_kernel')
    yield PlainOpsBackend.name
    PL.unregister_backend(PlainOpsBackend.name)


def _layer(stride=1, **kwargs):
    torch.manual_seed(0)
    return LambdaLayer(8, dim_k=4, heads=2, scope=5, stride=stride, form='tiled', position_bias=True,
                       **kwargs).double()


def _step(layer, x):
    """Output and the gradients of the input and every parameter, for a fixed output gradient."""
    x = x.detach().requires_grad_()
    y = layer(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    grads = torch.autograd.grad(y, [x] + list(layer.parameters()), g)
    return [y.detach()] + list(grads)


def _served(name):
    return {k[4] for k in PL.served_backends() if k[1] == name}


@pytest.mark.parametrize('stride', [1, 2])
def test_a_backend_from_this_file_serves_the_layer_in_eager_mode_and_compiled(test_backend, backend, stride):
    """Registered here, chosen by name: it computes the forward and the backward of the layer, eager and under
    torch.compile (no other file knows it), equal to the gemm backend's; 'auto' tries it first where it is
    registered first, and passes over it for a dtype it does not declare."""
    x = torch.randn(2, 8, 9, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    layer = _layer(stride)
    backend('gemm')
    want = _step(layer, x)
    for name in (test_backend, 'auto'):
        backend(name)
        PL.served_backends(reset=True)
        got = _step(layer, x)
        assert _served(test_backend) == {'forward', 'backward'}, PL.served_backends()
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(layer), backend='aot_eager', fullgraph=True)
    PL.served_backends(reset=True)
    got = _step(compiled, x)
    assert _served(test_backend) == {'forward', 'backward'}, PL.served_backends()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    PL.served_backends(reset=True)
    _step(layer.float(), x.float())
    assert not _served(test_backend) and backends.why_not(test_backend, backends.Call('tiled', 'cpu', torch.float32))


@pytest.mark.parametrize('stride', [1, 2])
def test_the_execution_mode_is_read_once_a_call(monkeypatch, stride):
    """A training step in eager mode: one read of the mode (the plan's), whatever the layer then does with it (its
    projection, the operator, the kernels); no other code of the package asks whether it is compiled, traced,
    exported or transformed."""
    import sys
    reads = collections.Counter()
    mode = execution.mode

    def counted(x):
        reads['mode'] += 1
        return mode(x)

    def asked(name, fn):
        def check(*args, **kwargs):
            caller = sys._getframe(1).f_code
            if 'timm_lambda' in caller.co_filename and caller.co_name != 'mode':
                reads[f'{name} from {caller.co_name}'] += 1
            return fn(*args, **kwargs)
        return check
    from timm_lambda.layers import lambda_layer
    monkeypatch.setattr(plan, 'execution_mode', counted)
    monkeypatch.setattr(lambda_layer, 'execution_mode', counted)
    monkeypatch.setattr(execution, 'mode', counted)
    for module, name in ((torch.compiler, 'is_compiling'), (torch.jit, 'is_tracing'), (execution, 'is_exporting'),
                         (execution, 'functorch_active')):
        monkeypatch.setattr(module, name, asked(name, getattr(module, name)))
    layer = _layer(stride)
    _step(layer, torch.randn(2, 8, 9, 7, dtype=torch.float64))
    assert reads == {'mode': 1}


@pytest.mark.parametrize('stride', [1, 2])
def test_the_compiled_backward_runs_the_forwards_backend(backend, stride):
    """Under torch.compile the plan is made while tracing and both operators take it: the backward's backend is the
    forward's (the gemm backend chosen by name, then 'auto''s choice), and one graph serves both."""
    x = torch.randn(2, 8, 9, 7, dtype=torch.float64)
    for name in ('gemm', 'auto'):
        backend(name)
        torch._dynamo.reset()
        layer = _layer(stride)
        compiled = torch.compile(layer, backend='aot_eager', fullgraph=True)
        PL.served_backends(reset=True)
        _step(compiled, x)
        served = PL.served_backends()
        ran = {k[4]: k[1] for k in served}
        assert set(ran) == {'forward', 'backward'} and ran['forward'] == ran['backward'], served
        assert name == 'auto' or ran['forward'] == name


@pytest.mark.parametrize('stride', [1, 2])
def test_one_graph_at_symbolic_sizes(backend, stride):
    """With ``dynamic=True`` the plan is made in the graph at symbolic sizes (the scope's reach a guarded branch, the
    backend's choice a constant): one graph (fullgraph), equal to eager mode at sizes that share it."""
    backend('auto')
    torch._dynamo.reset()
    layer = _layer(stride)
    compiled = torch.compile(copy.deepcopy(layer), backend='aot_eager', fullgraph=True, dynamic=True)
    for shape in ((2, 8, 9, 7), (2, 8, 6, 5)):
        x = torch.randn(shape, dtype=torch.float64)
        for got, want in zip(_step(compiled, x), _step(layer, x)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


class _BreakingNorm(torch.nn.BatchNorm2d):
    """A batch norm with a graph break in it (a user's norm layer that dynamo cannot trace)."""

    def forward(self, x):
        torch._dynamo.graph_break()
        return super().forward(x)


@pytest.mark.parametrize('stride', [1, 2])
def test_a_plan_across_a_graph_break(backend, stride):
    """A graph break between the plan and the operator (in the query and value norms): the resumed graph receives the
    plan's ints as symbols (``dynamic=True``), which the operator's checks take as the ints they are (they were
    unhashable there: a TypeError while tracing)."""
    backend('auto')
    torch._dynamo.reset()
    layer = _layer(stride, norm_layer=_BreakingNorm)
    compiled = torch.compile(copy.deepcopy(layer), backend='aot_eager', dynamic=True)
    for shape in ((2, 8, 9, 7), (2, 8, 6, 5)):
        x = torch.randn(shape, dtype=torch.float64)
        for got, want in zip(_step(compiled, x), _step(layer, x)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


class _Failing(PlainOpsBackend):
    """Fails at run time as a backend that cannot run here does (a Triton that cannot compile), once."""
    name = 'test_failing'
    calls = 0

    def forward(self, plan, *tensors):
        type(self).calls += 1
        raise BackendUnusable('cannot run here (a test)')


def test_a_backend_failing_at_run_time_is_handed_on_once(backend):
    """Under 'auto', a backend that raises BackendUnusable is recorded as failed with one warning, the call (forward
    and backward) runs by the next backend the registry chooses, and the next plans pass over it; in strict mode it
    raises."""
    PL.register_backend(_Failing(), before='cpu_kernel')
    try:
        backend('auto', strict=False)
        PL.served_backends(reset=True)
        layer, x = _layer(), torch.randn(2, 8, 9, 7, dtype=torch.float64)
        with pytest.warns(RuntimeWarning, match='the test_failing backend of the position lambdas failed'):
            _step(layer, x)
        _step(layer, x)
        assert _Failing.calls == 1
        ran = {k[1] for k in PL.served_backends()}
        assert ran == {'cpu_kernel' if PL.backends.get('cpu_kernel').unavailable() is None else 'gemm'}
        backends.clear_failures(['test_failing'])
        backend('auto', strict=True)
        with pytest.raises(BackendUnusable, match='cannot run here'):
            _step(layer, x)
    finally:
        PL.unregister_backend('test_failing')


class _Reads(TorchDispatchMode):
    """The storages each aten operator reads and writes, in order."""

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [a for a in torch.utils._pytree.tree_leaves(out) if isinstance(a, torch.Tensor)]
        self.events.append((str(func), [_storage(t) for t in ins], [_storage(t) for t in outs]))
        return out


def _storage(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize('path', ['eager', 'dispatch'])
@pytest.mark.parametrize('name', ['gemm', 'cpu_kernel'])
@pytest.mark.parametrize('stride', [1, 2])
def test_everything_the_backward_reads_went_through_saved_tensors_hooks(backend, monkeypatch, name, stride, path):
    """A training step inside ``saved_tensors_hooks`` whose pack hook copies each saved tensor: no operator of the
    backward reads a tensor the forward made other than through those copies (the content lambda and the normalised
    keys included; kept on the autograd context, they would be read directly), and the gradients are the step's
    without hooks. Both paths of the operator: its eager autograd function and the registered operator (what
    torch.compile and dispatch modes run). (The reads are seen by a dispatch mode, which the layer's plan would take
    for the registered operator's: the eager path is forced.)"""
    from timm_lambda.layers import lambda_layer
    monkeypatch.setattr(lambda_layer, 'execution_mode', lambda x: path)
    backend(name)
    layer, x = _layer(stride), torch.randn(2, 8, 9, 7, dtype=torch.float64)
    want = _step(layer, x)
    copies = set()

    def pack(t):
        c = t.detach().clone()
        copies.add(_storage(c))
        return c

    forward, backward = _Reads(), _Reads()
    xg = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda c: c), forward:
        y = layer(xg)
    made = {s for _, _, outs in forward.events for s in outs} - copies
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    with backward:
        grads = torch.autograd.grad(y, [xg] + list(layer.parameters()), g)
    fresh, direct = {_storage(g)}, []  # (the output gradient may take the memory of a forward tensor freed since)
    for func, ins, outs in backward.events:
        direct += [(func, s) for s in ins if s in made and s not in fresh]
        fresh.update(outs)
    assert not direct, f'the backward read tensors of the forward that no hook saw: {direct[:5]}'
    for a, b in zip([y.detach()] + list(grads), want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_checkpointing_a_stack_of_lambda_layers_gives_the_same_gradients():
    """``torch.utils.checkpoint(use_reentrant=False)`` around each layer of a stack (what frees their saved tensors:
    benchmarks measure the memory) recomputes the forward in the backward: the same gradients."""
    torch.manual_seed(0)
    stack = torch.nn.Sequential(*[_layer(s) for s in (1, 2, 1)])
    x = torch.randn(2, 8, 12, 11, dtype=torch.float64)
    want = _step(stack, x)

    class Checkpointed(torch.nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = layers

        def forward(self, x):
            for layer in self.layers:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            return x
    got = _step(Checkpointed(stack), x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
