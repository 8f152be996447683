"""Double backward (``create_graph=True``, then a gradient of the gradients) through the position lambdas' custom
operators against the plain-op forms they hand over to (``custom_ops._plain_vjp``), where the zeros-or-None choice
shows: a first gradient that does not depend on some input (the output is linear in the queries and in the content
lambda), so the second-order gradient of that input is disconnected. Autograd's contract, as the plain-op forms
give it: None with ``allow_unused=True``, an error without it; not a tensor of zeros. (At stride 2 the pooling's
backward keeps the queries in the graph with a zero derivative, autograd's formula for ``avg_pool2d_backward``: there
the plain-op forms give the queries zeros, and so must the operators.)

gradgradcheck and second-order values of every form against the einsum form's: tests/test_position_lambda.py."""
import pytest
import torch

from _helpers import force_plain_ops
from timm_lambda.layers import position_lambda as PL
from timm_lambda.layers.position_lambda import custom_ops

B, H, W, HEADS, K, U, V, SCOPE = 2, 7, 6, 2, 3, 1, 4, 5


def _leaves(stride):
    g = torch.Generator().manual_seed(stride)
    q = torch.randn(B, HEADS, K, H * W, generator=g, dtype=torch.float64)
    v = torch.randn(B, U, V, H * W, generator=g, dtype=torch.float64)
    table = torch.randn(K, U, SCOPE, SCOPE, generator=g, dtype=torch.float64)
    content = torch.randn(B, K, V, generator=g, dtype=torch.float64)
    weight = torch.randn(B, HEADS * V, -(-H // stride), -(-W // stride), generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, v, table, content)], weight


NAMES = ['q', 'v', 'table', 'content']
# the first gradient penalised -> the inputs its gradient does not depend on (their second-order gradient is None)
PENALISED = {'q': {'q'}, 'content': {'v', 'table', 'content'}}


def _second_order(impl, stride, penalised):
    """A loss linear in the output (a fixed weight per entry), the first gradients with create_graph=True, then the
    gradient of the squared norm of one of them with allow_unused=True."""
    leaves, weight = _leaves(stride)
    q, v, table, content = leaves
    y = PL.position_lambdas(q, v, table, H, W, impl, False, stride, False, None, content)
    first = torch.autograd.grad((y * weight).sum(), leaves, create_graph=True)
    penalty = first[NAMES.index(penalised)].square().sum()
    second = torch.autograd.grad(penalty, leaves, retain_graph=True, allow_unused=True)
    if any(g is None for g in second):
        with pytest.raises(RuntimeError, match='not have been used in the graph'):
            torch.autograd.grad(penalty, leaves)
    return second


@pytest.mark.parametrize('penalised', sorted(PENALISED))
@pytest.mark.parametrize('stride', [1, 2])
@pytest.mark.parametrize('impl', ['dense', 'tiled'])
def test_a_disconnected_second_order_gradient_is_none_as_in_the_plain_op_forms(impl, stride, penalised, monkeypatch):
    """The custom operators (tiled at stride 1: the content lambda inside the operator) against the same form in plain
    ops and the einsum form: None for the same inputs, equal values for the others."""
    ops = _second_order(impl, stride, penalised)
    einsum = _second_order('einsum', stride, penalised)
    force_plain_ops(monkeypatch)
    plain = _second_order(impl, stride, penalised)
    for name, got, same_form, other_form in zip(NAMES, ops, plain, einsum):
        assert (got is None) == (same_form is None) == (other_form is None), name
        if got is not None:
            assert name in PENALISED[penalised] or got.abs().max() > 1e-3, name
            torch.testing.assert_close(got, same_form, rtol=1e-10, atol=1e-10, msg=name)
            torch.testing.assert_close(got, other_form, rtol=1e-10, atol=1e-10, msg=name)
    none = {name for name, got in zip(NAMES, ops) if got is None}
    assert none == (PENALISED[penalised] if stride == 1 or penalised == 'content' else set())


def test_the_higher_order_backward_gives_none_for_an_input_its_plain_form_does_not_reach():
    """The operators' create_graph backward (``_plain_vjp``) returns what autograd returns for the plain form: None
    for an input it does not reach (autograd's zero, which leaves ``.grad`` None), not a tensor of zeros; and None for
    an input that needs no gradient."""
    a, b, c = (torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad = torch.randn(3, dtype=torch.float64)

    def plain(a, b, c, step):
        return a * step * c

    got = custom_ops._plain_vjp(plain, [a, b, c, 2], (0, 1, 2), grad, (True, True, False))
    want = torch.autograd.grad(plain(a, b, c, 2), (a, b), grad, allow_unused=True)
    assert got[1] is None and want[1] is None and got[2] is None
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert got[0].requires_grad  # differentiable again: its graph reaches c
