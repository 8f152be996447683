"""torch.compile training at a second input size (issue 39): equal to eager mode, float64, loss and every parameter
gradient within 1e-8 (``dynamic=True`` from the first step: every block type, tests/test_compile_blocks.py).

A second size makes dynamo recompile with symbolic sizes (automatic dynamic shapes), as ``dynamic=True`` does from the
first step. Inductor then orders the strides of every view the compiled forward saves for backward by sympy
comparisons; at symbolic sizes it could not decide those of the dense form's embedding view (``1 < n``), a TypeError
at the second size of progressive resizing, fine-tuning at a new resolution and multi-scale training (torch 2.14.1).

In CI: a small LambdaResNet whose c4 stage (one bottleneck, its stride-2 lambda layer on the dense form, as
``form='auto'`` picks it for small maps) is compiled with inductor: that stage alone failed as the whole network did,
in a fraction of its compile time (an inductor compile of a whole network at symbolic sizes takes minutes on 2
cores: lambdaresnet50 at 96 px after 64 px, 14 min on 2 busy cores; compiling the lambda layer alone did not fail).
The layer passes copies where the compiled forward would save views (``execution.compiled_copy``). Behind
``--heavy``: whole registered networks, ``torch.compile(model)`` as timm's ``train.py --torchcompile`` does it.
"""
import copy

import pytest
import timm
import torch
import torch.nn.functional as F

import timm_lambda  # noqa: F401


@pytest.fixture
def inductor():
    """A fresh dynamo cache; no vectorisation (its tiling choice runs sympy over the symbolic sizes: tests/test_export
    compiles AOTInductor packages so too)."""
    import torch._inductor.config as inductor_config
    torch._dynamo.reset()
    with inductor_config.patch({'cpp.simdlen': 1}):
        yield
    torch._dynamo.reset()


def _small(form='auto'):
    torch.manual_seed(0)
    return timm.create_model(
        'lambdaresnet50', layers=(1, 1, 1, 1), channels=(8, 16, 32, 64), stem_width=8, stem_type='',
        replace_stem_pool=False, avg_down=False, lambda_blocks=(None, None, 'all', None), dim_k=4, heads=2,
        se_stages=(), num_classes=3, zero_init_last=False, form=form).double().train()


def _step(model, x, y):
    for p in model.parameters():
        p.grad = None
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _train_like_eager(eager, compiled, sizes, batch=2):
    """A training step of both at each size (height, width): the same loss and parameter gradients (1e-8 of the
    largest)."""
    gen = torch.Generator().manual_seed(0)
    for hw in sizes:
        x = torch.randn(batch, 3, *hw, generator=gen, dtype=torch.float64)
        y = torch.randint(0, eager.num_classes, (batch,), generator=gen)
        loss, grads = _step(eager, x, y)
        loss_c, grads_c = _step(compiled, x, y)
        assert _rel(loss_c, loss) < 1e-8, (hw, float(loss_c), float(loss))
        # relative to the largest gradient: a parameter whose gradient is zero in exact arithmetic (a shift before a
        # batch norm) gets rounding noise in both, no relative agreement
        scale = max(float(g.abs().max()) for g in grads)
        worst = max(float((gc - g).abs().max()) for gc, g in zip(grads_c, grads)) / scale
        assert worst < 1e-8, (hw, worst)


@pytest.mark.slow
@pytest.mark.parametrize('batch', [2, 1])
def test_compiled_training_at_a_second_size_equals_eager(inductor, batch):
    """32 px, then 48x40 and 40x56 (not square): the first size compiles with static sizes, the second recompiles
    with symbolic ones (the failing compile), the third runs that graph. Batch 1 (at 64 px, then 96x80: c5's batch
    norm needs more than one value a channel): there inductor could not order the strides of the query and value
    channel slices the norms save (``8*s0*s1 < 8``), until the layer passed copies of them under compile."""
    eager = _small()
    compiled = copy.deepcopy(eager)
    compiled.layer3 = torch.compile(compiled.layer3)
    sizes = [(32, 32), (48, 40), (40, 56)] if batch > 1 else [(64, 64), (96, 80)]
    _train_like_eager(eager, compiled, sizes, batch=batch)


def _registered():
    return timm_lambda.registered_models()


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize('name', _registered())
def test_every_registered_model_compiles_at_any_size(name, inductor):
    """``torch.compile(model)`` of each registered network (timm's defaults, 10 classes): a training step at 64 px,
    then at 96 and 80x112 px, and a ``dynamic=True`` compile at 96x64 px, equal to eager in float64 (a quarter of
    those sizes for the CIFAR-stem networks, which do not downsample before c2). Global-scope and fixed-size networks
    are built for the largest size."""
    kwargs = dict(num_classes=10)
    model = timm.create_model(name, **kwargs)
    scale = 4 if getattr(type(model), 'stem_reduction', 4) == 1 else 1
    if getattr(model, 'global_img_size', None) is not None or name.startswith(('aa_resnet', 'resnet50_global',
                                                                             'resnet50_axial')):
        kwargs['img_size'] = 112 // scale
    torch.manual_seed(0)
    eager = timm.create_model(name, **kwargs).double().train()
    compiled = torch.compile(copy.deepcopy(eager))
    _train_like_eager(eager, compiled, [(64 // scale, 64 // scale), (96 // scale, 96 // scale),
                                        (80 // scale, 112 // scale)])
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(eager), dynamic=True)
    _train_like_eager(eager, compiled, [(96 // scale, 64 // scale)])
