"""Whole models in the execution modes users run: evaluation under torch.inference_mode() before and between
training steps, and torch.compile as timm's ``train.py --torchcompile`` and mmengine's ``compile=True`` use it
(marked ``heavy``: ~10 minutes of one core from a cold inductor cache, run with ``pytest --heavy``, not in CI; the
layer under inductor is in CI: tests/test_lambda_layer.py::test_torch_compile_matches_eager). Each mode at the level
of one layer (torch.func per-sample gradients, jacfwd, double backward, autocast, the compiled graph):
tests/test_position_lambda.py and tests/test_lambda_layer.py."""
import pytest
import timm
import torch
from torch import nn

import timm_lambda  # noqa: F401


@pytest.mark.parametrize('name,kw,size', [
    ('lambdaresnet50', dict(layers=(1, 1, 1, 1), lambda_blocks=(None, None, 'all', 'all')), 96),
    ('resnet50_lambda_global32', {}, 32),
    ('mobilenetv2_100_lambda', {}, 64),
])
def test_inference_mode_before_and_between_training_steps(name, kw, size):
    """Evaluation first (Lightning's validate-then-fit, timm's benchmark.py --bench both), then training steps,
    evaluation between them, at the same size: every step trains."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 3, size, size)
    for _ in range(2):
        model.eval()
        with torch.inference_mode():
            model(x)
        with torch.no_grad():
            model(x)
        model.train()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), torch.tensor([1, 3]))
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


# --- torch.compile end to end -------------------------------------------------------------------------------

def _train_steps(model, steps=3, seed=0):
    """SGD steps of timm's train.py kind on a fixed batch: the losses and the final parameters."""
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.heavy
def test_train_py_torchcompile_flow():
    """train.py --torchcompile: create_model, torch.compile(model) (inductor), then train: the compiled
    model's losses and parameters track the eager model's over three steps; the lambda layers run their
    kernels inside the compiled graph (no fallback to plain ops)."""
    def small():
        torch.manual_seed(0)
        return timm.create_model('lambdaresnet50', num_classes=10, layers=(1, 1, 1, 1),
                                 lambda_blocks=(None, None, 'all', 'all')).train()

    eager_losses, eager_params = _train_steps(small())
    torch._dynamo.reset()
    compiled_losses, compiled_params = _train_steps(torch.compile(small()))
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-3)
    for a, b in zip(compiled_params, eager_params):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.slow
@pytest.mark.heavy
def test_mmengine_compile_true_on_a_shrunk_table14_config(tmp_path):
    """MMDetection's Mask R-CNN from the Table 14 config (shrunk: 64 px, one block per stage, batch 2) with
    mmengine's ``compile=True`` (torch.compile of the model's train_step): its first loss (same weights, same
    batch) equals the eager run's, and the next one (after one optimizer step) follows it. Not later ones: a
    last-bit difference in the weights can flip which proposals Mask R-CNN's samplers keep, a ~1% loss step
    (seen in CI at the third iteration)."""
    import os.path as osp

    from mmengine.runner import Runner

    import _det  # noqa: F401  (skips without the [det] extra)
    from _lib.quickstart import build_config
    from _lib.synthetic_coco import make_coco_dataset
    from _mmdet_helpers import CONFIG_DIR

    data = make_coco_dataset(str(tmp_path / 'data'), num_train=8, num_val=2, image_size=96, seed=0)
    config = osp.join(CONFIG_DIR, 'mask-rcnn_lambdaresnet101_fpn_syncbn_lsj-130k_coco.py')
    losses = {}
    for mode in ('eager', 'compile'):
        cfg = build_config(data, str(tmp_path / mode), config, image_size=64, batch_size=2, iters=2, warmup_iters=2,
                           log_interval=1,
                           model_kwargs=dict(layers=(1, 1, 1, 1), lambda_blocks=(None, None, 'all', 'all')))
        cfg.compile = mode == 'compile'
        cfg.train_dataloader.num_workers = 0
        cfg.train_dataloader.persistent_workers = False
        torch._dynamo.reset()
        runner = Runner.from_cfg(cfg)
        runner.train()
        losses[mode] = list(runner.message_hub.get_scalar('train/loss').data[0])
    assert len(losses['compile']) == len(losses['eager']) == 2
    assert losses['compile'][0] == pytest.approx(losses['eager'][0], rel=1e-4)
    assert losses['compile'][1] == pytest.approx(losses['eager'][1], rel=2e-2)


@pytest.mark.slow
def test_gpu_benchmark_command_runs(capsys):
    """``benchmarks/benchmark_models.py cuda`` (float32 and bfloat16 autocast, LambdaResNet-101 vs ResNet-RS-101+SE
    and LambdaResNet-50 vs timm's lambda_resnet50ts) runs end to end; here on the CPU at 64 px, since CI has
    no GPU: the command a lent GPU would run is the same code."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / 'benchmarks' / 'benchmark_models.py'
    spec = importlib.util.spec_from_file_location('benchmark_models', path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    results = tool.cuda_comparison('cpu', repeats=1, backbone_batch=1, classifier_batch=1, sizes=(64, 64))
    out = capsys.readouterr().out
    assert len(results) == 4 and 'img/s' in out and "timm's lambda_resnet50ts" in out
    assert {r['dtype'] for r in results} == {'torch.float32', 'torch.bfloat16'}


def test_torchscript_never_takes_a_tuple_for_a_freed_builtin():
    """The CI flake "builtin cannot be used as a value" (timm's TorchScript tests, at a Conv2d's padding tuple):
    TorchScript finds builtin ops by ``id()``; an op object freed when its packet is refreshed by a new overload left
    its id behind, and a 4-tuple allocated at that address scripted as that op. tests/conftest.py keeps the registered
    objects alive: no tuple allocated after the refresh is taken for a builtin, and a Conv2d holding one scripts."""
    from torch.jit._builtins import _find_builtin
    lib = torch.library.Library('timm_lambda_test_refresh', 'DEF')
    lib.define('f(Tensor x) -> Tensor')
    packet = torch.ops.timm_lambda_test_refresh.f  # registers the packet's op object as a builtin
    first = packet._op
    del first
    lib.define('f.other(Tensor x, int n) -> Tensor')  # refreshes the packet: a new op object
    tuples = [tuple(1 for _ in range(4)) for _ in range(20000)]  # new objects, as a Conv2d's padding
    assert [t for t in tuples if _find_builtin(t) is not None] == []
    conv = nn.Conv2d(2, 2, 3, padding=1, padding_mode='reflect')
    conv._reversed_padding_repeated_twice = tuples[-1]
    x = torch.randn(1, 2, 5, 5)
    torch.testing.assert_close(torch.jit.script(conv)(x), conv(x))
    lib._destroy()
