"""Peak memory of a step (benchmarks/harness/measure.py) counts what the CPU allocator hands out, inside
custom operators too: a custom operator's own scratch, and the lambda layer's dense form (one custom operator
holding the logits ``[b, h n, m]`` inside) against the same arithmetic in plain ops."""
import statistics

import pytest
import torch

from _helpers import load_file
from harness.measure import peak_of_memory_events, peak_step_bytes, step_macs
from timm_lambda.layers import LambdaLayer

MIB = 2 ** 20


@torch.library.custom_op('test_measure::scratch_sum', mutates_args=())
def _scratch_sum(x: torch.Tensor, copies: int) -> torch.Tensor:
    """Sums ``copies`` stacked copies of ``x``: a scratch of ``copies * x.nbytes`` bytes lives inside the op."""
    return x.expand(copies, *x.shape).contiguous().sum(0)


@_scratch_sum.register_fake
def _(x, copies):
    return torch.empty_like(x)


def _event(ts, addr, nbytes, device_type=0):
    return dict(name='[memory]', ts=ts, args={'Addr': addr, 'Bytes': nbytes, 'Device Type': device_type})


def test_running_sum_of_allocator_events():
    """Peak of the blocks allocated during the profile and alive at once; a free of an older block, a CUDA
    event and other events do not count; events are taken in time order."""
    events = [_event(5, 0xA, -300),  # freed, allocated before the profile: not counted
              _event(1, 0x1, 100), _event(2, 0x2, 50), _event(3, 0x1, -100), _event(4, 0x3, 70),
              _event(6, 0x4, 1000, device_type=1), dict(name='aten::mm', ts=2.5, args={})]
    assert peak_of_memory_events(events) == 150  # 0x1 and 0x2 at once; then 0x2 and 0x3 = 120
    assert peak_of_memory_events(sorted(events, key=lambda e: -e['ts'])) == 150
    assert peak_of_memory_events([]) == 0


def test_sees_the_scratch_of_a_custom_operator():
    x = torch.randn(256, 256)  # 256 KiB
    peak = peak_step_bytes(lambda: _scratch_sum(x, 32))
    assert 32 * x.nbytes <= peak <= 34 * x.nbytes


def _dense_layer_steps(training: bool):
    """A lambda layer in the dense form whose logits [b, h n, m] dominate its memory: 32 heads, |k|=2,
    16x16 input, batch 2 (logits 16 MiB, the embedding 0.5 MiB)."""
    torch.manual_seed(0)
    b, heads, size = 2, 32, 16
    layer = LambdaLayer(64, dim_k=2, heads=heads, scope=23, form='dense').train(training)
    x = torch.randn(b, 64, size, size, requires_grad=training)

    def step():
        if training:
            x.grad = None
            layer.zero_grad(set_to_none=True)
            layer(x).sum().backward()
        else:
            with torch.no_grad():
                layer(x)
    logits_bytes = b * heads * (size * size) ** 2 * 4
    return step, logits_bytes


def test_dense_form_inference_matches_its_plain_op_form(backend):
    """Forward without grad: the custom operator computes the same logits and product as the plain ops,
    so the peaks agree (the forms build the embedding differently: 2% here); both hold the logits."""
    step, logits_bytes = _dense_layer_steps(training=False)
    kernel_peak = peak_step_bytes(step)
    backend('plain')
    plain_peak = peak_step_bytes(step)
    assert plain_peak >= logits_bytes
    assert kernel_peak == pytest.approx(plain_peak, rel=0.05), (kernel_peak / MIB, plain_peak / MIB)


def test_dense_form_training_step_holds_logits_and_their_gradient():
    """The custom operator's backward holds the logits (recomputed) and their gradient at once."""
    step, logits_bytes = _dense_layer_steps(training=True)
    assert peak_step_bytes(step) >= 2 * logits_bytes


def _tool(name: str):
    """benchmarks/<name>.py as a new module."""
    return load_file(f'benchmarks/{name}.py', name)


def test_memory_only_run_replaces_the_memory_of_a_saved_result(tmp_path):
    """``benchmark_lambda_layer.py --memory-only --json FILE``: the timings in FILE stay, each ``peak_mib`` is
    the new measurement, the memory run is recorded."""
    import json
    path = tmp_path / 'sweep.json'
    saved = dict(machine='timing run', results=[dict(size=8, conv3x3=dict(ms=3.0, peak_mib=-1.0),
                                                     dense=dict(ms=2.0, peak_mib=-1.0))])
    path.write_text(json.dumps(saved))
    _tool('benchmark_lambda_layer').main(['--memory-only', '--sweep', '--width', '32', '--sizes', '8',
                                          '--json', str(path)])
    result = json.loads(path.read_text())
    row = result['results'][0]
    assert result['machine'] == 'timing run' and row['conv3x3']['ms'] == 3.0 and row['dense']['ms'] == 2.0
    assert all(row[k]['peak_mib'] > 0 for k in ('conv3x3', 'dense', 'tiled', 'conv', 'einsum'))
    assert '--memory-only' in result['memory']['command']


@pytest.mark.slow
def test_model_goals_against_the_skipped_lambda_layers(monkeypatch, capsys):
    """``benchmarks/benchmark_models.py c4``'s bound: the candidate with its lambda layers skipped has none left and the
    same feature shapes; the multiply-adds the goals are divided by are exactly the lambda layers' own (counted layer
    by layer on the inputs they get in the network); a goal's budget is goal x baseline - skipped (medians)."""
    tool = _tool('benchmark_models')
    monkeypatch.setattr(tool, 'fma_peak_gmacs', lambda: 100.0)  # the yardstick is not under test (no compile)
    x = torch.randn(1, 3, 64, 64)
    full = tool.build('lambdaresnet101_c4', {}, 'features').eval()
    skipped = tool.build('lambdaresnet101_c4', tool.SKIPPED, 'features').eval()
    assert not any(isinstance(m, LambdaLayer) for m in skipped.modules())
    layers = [m for m in full.modules() if isinstance(m, LambdaLayer)]
    assert len(layers) == 26 and {m.stride for m in layers} == {1, 2}  # every c4 and c5 block
    inputs = []
    hooks = [m.register_forward_pre_hook(lambda m, args: inputs.append((m, args[0]))) for m in layers]
    with torch.no_grad():
        assert [f.shape for f in skipped(x)] == [f.shape for f in full(x)]
        for hook in hooks:
            hook.remove()
        own = sum(step_macs(lambda m=m, a=a: m(a)) for m, a in inputs)

    result = tool.compare('c4', 64, 1, 'cpu', repeats=1)
    assert '| rate the goal needs (GMAC/s) |' in capsys.readouterr().out
    budgets = {b['mode']: b for b in result['goal_budgets']}
    assert set(budgets) == {'training step', 'inference'}
    assert budgets['inference']['lambda_gmacs'] * 1e9 == pytest.approx(own, rel=1e-12)
    assert budgets['training step']['lambda_gmacs'] > 2 * budgets['inference']['lambda_gmacs']
    t = {k: statistics.median(v) for k, v in result['times'].items()}
    for mode, b in budgets.items():
        skip = t[f'LambdaResNet-101-C4, lambda layers skipped/{mode}']
        assert b['budget_s'] == pytest.approx(0.8 * t[f'LambdaResNet-101-C4 conv twin/{mode}'] - skip)
        assert b['lambda_s'] == pytest.approx(t[f'LambdaResNet-101-C4/{mode}'] - skip)
        assert b['limit_gmac_per_s'] == 100.0
