"""On a CUDA device (``pytest -m cuda``; skipped without one, never run in CI, which has no GPU): the
position-lambda forms and executions against the float64 reference, with gradients and under bf16/fp16
autocast; a training step of every registered model (NCHW and channels_last); the batch-1 gradient check of
tests/test_batch_one.py; mmdet's own train/test tools with Mask R-CNN for a few iterations at 512 px (which
needs mmcv with CUDA ops: ``TIMM_LAMBDA_MMCV_CUDA=1 bash tools/install.sh``, docs/install.md).

Everything here imports without CUDA (and without the [det] extra: the mmdet test imports it itself), so the
module is collected and its tests skipped with one reason on a machine without a GPU."""
import copy
import os.path as osp
import sys

import pytest
import timm
import torch

import _backend_matrix as M
import _launches
import _sixteen_bit as SB
import timm_lambda
from _batch_one import BLOCK_BY_BLOCK, check_model_batch_one, input_size, model_params, worst_grad_diff
from _cases import CASES, IDS
from _cases import call as _call
from _cases import inputs as _inputs
from _kernel_op import kernel_call
from _launches import Directions
from reference import position_term_reference
from timm_lambda.layers import position_lambda as PL
from timm_lambda.layers.position_lambda import gemm, tiled_triton

HAVE_CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAVE_CUDA, reason='needs a CUDA device (torch.cuda.is_available() is False)'),
]
DEV = 'cuda'


# --------------------------------------------------------------------------
# position lambdas: the CUDA case of the backend table's matrix (tests/_backend_matrix.py), every form by every
# backend that computes it on the device
# --------------------------------------------------------------------------
def _on_device(tensors, dtype=None):
    return [t.to(DEV, dtype).requires_grad_() for t in tensors]


@pytest.mark.parametrize('dtype', M.DTYPES, ids=M.DTYPE_IDS)
@pytest.mark.parametrize('name,form', M.ROWS, ids=M.ROW_IDS)
@pytest.mark.parametrize('case', M.MATRIX_CASES, ids=M.MATRIX_IDS)
def test_every_row_serves_its_calls_or_refuses_them_on_cuda(case, name, form, dtype, backend, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, 'allow_tf32', False)  # the conv form's float32: exact, as the bound
    M.check_row(backend, name, form, DEV, dtype, case)


@pytest.fixture(autouse=True)
def _nan_prefill():
    """As in the interpreted run (tests/_triton_interpreted.py): what torch allocates uninitialised starts as NaN
    (torch's deterministic mode fills it), so that an element no kernel wrote fails the comparison instead of passing
    as the allocator's leftovers."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before, warn_only=warn_only)


def _use(name, backend):
    """Run the position lambdas by backend ``name`` through the public override, strict (a kernel that fails raises:
    no other backend answers for it); a function that says whether a Triton kernel launched since (Triton's hooks,
    tests/_launches.py)."""
    backend(name, strict=True)
    _launches.hook_kernels()
    start = _launches.launched()
    return lambda: _launches.launched() > start


# the float64 rows (triton_tc computes 16-bit and float32: its refusal is the matrix's)
FLOAT64_ROWS = [('tiled', 'triton_fma'), ('tiled', 'gemm'), ('dense', 'gemm'), ('tiled', 'plain'), ('dense', 'plain')]
AUTOCAST_ROWS = [('tiled', 'triton_tc')] + FLOAT64_ROWS


@pytest.mark.parametrize('chunks', ['one', 'many'])
@pytest.mark.parametrize('form,execution', FLOAT64_ROWS, ids=['-'.join(r) for r in FLOAT64_ROWS])
@pytest.mark.parametrize('case', CASES, ids=IDS)
def test_forms_equal_the_reference_on_cuda(case, form, execution, chunks, monkeypatch, backend):
    """float64 on the device: outputs and gradients equal the per-query reference (computed on the CPU), in one chunk
    and in many."""
    launched = _use(execution, backend)
    if chunks == 'many':  # one query block (gemm) or one image (Triton) per chunk: the device loop over chunks
        monkeypatch.setattr(gemm, 'DEVICE_CHUNK_ELEMENTS', 1)
        monkeypatch.setattr(tiled_triton, 'CHUNK_ELEMENTS', 1)
        PL.backends.invalidate()  # (the plans read them)
    q, v, table = (t.requires_grad_() for t in _inputs(case))
    ref = position_term_reference(q, v, table, case[1], case[2], case[8], case[9])
    qd, vd, td = _on_device((q.detach(), v.detach(), table.detach()))
    directions = Directions()
    y = _call(form, case, qd, vd, td)
    directions.forward_done()
    assert y.device.type == DEV and y.dtype == torch.float64
    assert launched() == (execution == 'triton_fma'), 'Triton ran where it should not, or not'
    torch.testing.assert_close(y.cpu(), ref.detach(), rtol=1e-9, atol=1e-9)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=ref.dtype)
    got = torch.autograd.grad(y, (qd, vd, td), g.to(DEV))
    if execution == 'triton_fma':  # each direction ran its own kernels, at this case's stride
        directions.check('triton_fma', case[8], IDS[CASES.index(case)])
    want = torch.autograd.grad(ref, (q, v, table), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize('content', [False, True], ids=['position', 'with_content'])
@pytest.mark.parametrize('width, side, stride', [(256, 64, 1), (512, 64, 2), (512, 33, 1)], ids=['c4', 'c5_s2', 'c5'])
def test_triton_in_float32_equals_the_gemm_path_in_float64_at_backbone_shapes(width, side, stride, content,
                                                                              backend):
    """LambdaResNet layer shapes at 1024 px (many blocks and chunks, the 23x23 scope, |v| = 64 and 128): the Triton
    execution in float32 against the GEMM path in float64 (itself equal to the reference above), output and
    gradients (q, v, the table, the content lambda) within float32 rounding."""
    launched = _use('triton_tc', backend)
    torch.manual_seed(0)
    h, k, dv, n = 4, 16, width // 4, side * side
    inputs = [torch.randn(2, h, k, n), torch.randn(2, 1, dv, n), torch.randn(k, 1, 23, 23) / 23]
    if content:
        inputs.append(torch.randn(2, k, dv) / 8)

    def run(dtype, directions=None):
        leaves = _on_device(inputs, dtype)
        y = PL.position_lambdas(leaves[0], leaves[1], leaves[2], side, side, 'tiled', False, stride, False,
                                [23, 23], leaves[3] if content else None)
        if directions:
            directions.forward_done()
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(DEV, dtype)
        return [y] + list(torch.autograd.grad(y, leaves, g))

    directions = Directions()
    got = run(torch.float32, directions)
    assert launched(), 'Triton did not run'
    directions.check('triton_tc', stride, f'{width} ch {side} px')  # each direction ran its kernels, at both strides
    backend('gemm')
    want = run(torch.float64)
    for name, a, b in zip(['output', 'q', 'v', 'table', 'content'], got, want):
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < 1e-5, f'{name}: relative error {err:.2e}'


@pytest.mark.parametrize('dtype, tol', [(torch.float16, 1e-2), (torch.bfloat16, 4e-2)], ids=['fp16', 'bf16'])
@pytest.mark.parametrize('form,execution', AUTOCAST_ROWS, ids=['-'.join(r) for r in AUTOCAST_ROWS])
@pytest.mark.parametrize('case', CASES, ids=IDS)
def test_forms_under_autocast_close_to_float32(case, form, execution, dtype, tol, backend):
    """Autocast outputs (and gradients) in the autocast dtype, farther from the float32 result than a float32
    computation would be and within the low precision's rounding of it."""
    _use(execution, backend)
    inputs = _inputs(case, dtype=torch.float32)
    q32, v32, t32 = _on_device(inputs)
    y32 = _call(form, case, q32, v32, t32)
    g = torch.randn(y32.shape, generator=torch.Generator().manual_seed(5)).to(DEV)
    grads32 = torch.autograd.grad(y32, (q32, v32, t32), g)
    q, v, t = _on_device(inputs)
    with torch.autocast(DEV, dtype=dtype):
        y = _call(form, case, q, v, t)
    assert y.dtype == dtype and torch.isfinite(y).all()  # computed in the autocast dtype, as a matmul is
    err = ((y.float() - y32).norm() / y32.norm()).item()
    # farther from the float32 result than that result rounded to the dtype (a float32 computation whose output
    # alone is rounded: 2e-4 in float16, 1.7e-3 in bfloat16; a fixed 1e-4 let it pass); the rounding contract
    # itself: test_tensor_cores_round_as_a_16_bit_matmul_on_cuda (tests/_sixteen_bit.py's check_rounding)
    rounded = ((y32.to(dtype).float() - y32).norm() / y32.norm()).item()
    assert rounded < err < tol, f'{dtype} autocast output differs from float32 by a relative {err:.3g} ({rounded:.3g})'
    for a, b in zip(torch.autograd.grad(y, (q, v, t), g.to(y.dtype)), grads32):
        assert a.dtype == torch.float32  # gradients in the inputs' dtype
        err = ((a - b).norm() / b.norm()).item()
        assert err < 2 * tol, f'{dtype} autocast gradient differs from float32 by a relative {err:.3g}'


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
@pytest.mark.parametrize('case', SB.SIXTEEN_BIT_CASES, ids=SB.SIXTEEN_BIT_IDS)
def test_tensor_cores_round_as_a_16_bit_matmul_on_cuda(case, dtype, backend):
    """The tensor-core kernels on the device: output and gradients rounded as a 16-bit matmul's
    (tests/_sixteen_bit.py: the logits rounded once, float32 sums), not as a float32 computation's."""
    launched = _use('triton_tc', backend)
    g = torch.Generator().manual_seed(0)
    inputs = SB.operator_inputs(case, lambda *shape: torch.randn(shape, generator=g), dtype)
    gy = torch.randn(SB.output_shape(case), generator=g).to(dtype)
    directions = Directions()
    got = SB.operator_call(kernel_call, case, [t.to(DEV) for t in inputs], gy.to(DEV), directions.forward_done)
    assert launched()
    directions.check('triton_tc', case[8], SB.SIXTEEN_BIT_IDS[SB.SIXTEEN_BIT_CASES.index(case)])
    SB.check_rounding(got, case, inputs, gy, dtype)


@pytest.mark.parametrize('case', SB.SIXTEEN_BIT_CASES[:3], ids=SB.SIXTEEN_BIT_IDS[:3])
def test_float32_on_tf32_only_where_torch_allows_it(case, monkeypatch, backend):
    """float32 on the tensor-core kernels: exact float32 products by default (torch's matmuls too), within 1e-5 of
    the float64 reference; TF32 products where ``torch.backends.cuda.matmul.allow_tf32`` allows them, as cuBLAS's,
    farther from it (about 1e-4) but within TF32's rounding."""
    launched = _use('triton_tc', backend)
    g = torch.Generator().manual_seed(0)
    inputs = SB.operator_inputs(case, lambda *shape: torch.randn(shape, generator=g), torch.float32)
    gy = torch.randn(SB.output_shape(case), generator=g)
    want = SB.reference_call(case, inputs, gy)
    errs = {}
    for tf32 in (False, True):
        monkeypatch.setattr(torch.backends.cuda.matmul, 'allow_tf32', tf32)
        got = SB.operator_call(kernel_call, case, [t.to(DEV) for t in inputs], gy.to(DEV))
        errs[tf32] = max(((a.double().cpu() - b).norm() / b.norm()).item() for a, b in zip(got, want))
    assert launched()
    assert errs[False] < 1e-5 < 2e-5 < errs[True] < 5e-3, errs


# --------------------------------------------------------------------------
# every registered model: one SGD training step on the device, and its gradients against the CPU's
# --------------------------------------------------------------------------
def _float64_grads(model, x):
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    return [p.grad for p in model.parameters()]


# train-mode gradients of these networks amplify float64 rounding at initialisation (tests/test_batch_one.py's
# BLOCK_BY_BLOCK): their device-against-CPU comparison runs in eval mode
_CHAOTIC_IN_TRAIN_MODE = {name for name, train in BLOCK_BY_BLOCK if train}


@pytest.mark.parametrize('channels_last', [False, True], ids=['nchw', 'channels_last'])
@pytest.mark.parametrize('name', timm_lambda.registered_models())
def test_training_step_on_cuda(name, channels_last):
    """float32 on the device (as users train): finite loss and gradients, and SGD moves the parameters that have a
    gradient (timm's zero-initialised last norm of each residual block leaves the others without one at the first
    step). float64: the device's parameter gradients equal the CPU's (the CPU execution is tested against the
    per-query reference elsewhere), in the device's memory format."""
    torch.manual_seed(0)
    size = input_size(name)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    cpu_model = timm.create_model(name, num_classes=10)
    model = copy.deepcopy(cpu_model).to(DEV, memory_format=fmt).train()
    x = torch.randn(2, 3, size, size)
    xd = x.to(DEV).to(memory_format=fmt)
    target = torch.tensor([1, 7], device=DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    loss = torch.nn.functional.cross_entropy(model(xd), target)
    assert torch.isfinite(loss), loss
    opt.zero_grad()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads), 'missing or non-finite gradients'
    has_grad = [bool(g.any()) for g in grads]
    assert sum(has_grad) > 0.1 * len(grads), f'only {sum(has_grad)} of {len(grads)} parameters have a gradient'
    opt.step()
    changed = [not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters())]
    assert not any(c and not g for c, g in zip(changed, has_grad)), 'SGD moved a parameter without a gradient'
    assert sum(changed) >= 0.9 * sum(has_grad), f'SGD moved {sum(changed)} of {sum(has_grad)} parameters'
    with torch.no_grad():
        assert torch.isfinite(model.eval()(xd)).all()

    train = name not in _CHAOTIC_IN_TRAIN_MODE
    want = _float64_grads(copy.deepcopy(cpu_model).double().train(train), x.double())
    got = _float64_grads(cpu_model.double().to(DEV, memory_format=fmt).train(train), xd.double())
    worst = worst_grad_diff([g.cpu() for g in got], want)
    assert worst < 1e-6, f'float64 parameter gradients on {DEV} differ from the CPU\'s by a relative {worst:.3g}'


def test_downsample_pool_gradient_of_a_channels_last_input_on_cuda():
    """The stride-2 pool's input gradient on the device, channels-last input, against the CPU's (torch's CUDA
    kernel for that layout is wrong with padding: timm_lambda/layers/pooling.py)."""
    from timm_lambda.layers.pooling import avg_pool_3x3_s2
    x = torch.randn(2, 6, 9, 8, dtype=torch.float64)
    g = torch.randn(2, 6, 5, 4, dtype=torch.float64)
    for include in (False, True):
        ref = x.clone().requires_grad_()
        avg_pool_3x3_s2(ref, include).backward(g)
        xd = x.to(DEV).contiguous(memory_format=torch.channels_last).requires_grad_()
        y = avg_pool_3x3_s2(xd, include)
        torch.testing.assert_close(y.cpu(), avg_pool_3x3_s2(x, include), rtol=1e-12, atol=1e-12)
        y.backward(g.to(DEV))
        torch.testing.assert_close(xd.grad.cpu(), ref.grad, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------
# batch size 1 on the device (tests/test_batch_one.py's check)
# --------------------------------------------------------------------------
@pytest.mark.parametrize('name,train', model_params())
def test_model_batch_one_equals_duplicated_batch_on_cuda(name, train):
    check_model_batch_one(name, train, DEV)


# --------------------------------------------------------------------------
# MMDetection: Mask R-CNN train (a few iterations) and test with mmdet's own tools, on the GPU
# --------------------------------------------------------------------------
@pytest.mark.slow
def test_mmdet_mask_rcnn_train_test_on_cuda(tmp_path):
    pytest.importorskip('mmdet', reason='detection extra not installed (pip install "timm-lambda[det]")')
    from _lib.synthetic_coco import make_coco_dataset
    from _mmdet_helpers import CLASSES, CONFIG_DIR, MMDET_TOOLS, run
    from timm_lambda_mmdet.mmcv_cuda import mmcv_has_cuda_ops
    from timm_lambda_mmdet.overrides import small_run_overrides, to_cli_options

    assert mmcv_has_cuda_ops(), ('mmcv has CPU-only ops: rebuild it with `TIMM_LAMBDA_MMCV_CUDA=1 bash '
                                 'tools/install.sh` (docs/install.md, "GPU (CUDA) install")')
    config = osp.join(CONFIG_DIR, 'mask-rcnn_lambdaresnet101_fpn_syncbn_lsj-130k_coco.py')
    root = str(tmp_path / 'coco')
    make_coco_dataset(root, num_train=8, num_val=2, image_size=512, seed=3)

    def options(**kw):
        return to_cli_options(small_run_overrides(root, image_size=512, classes=CLASSES,
                                                  num_classes=len(CLASSES), validate=False, **kw))

    work = str(tmp_path / 'work')
    rc, out = run([sys.executable, osp.join(MMDET_TOOLS, 'train.py'), config, '--work-dir', work,
                   '--cfg-options'] + options(max_iters=3, batch_size=2), timeout=900)
    assert rc == 0, out[-4000:]
    assert 'CUDA available: True' in out, out[:3000]  # mmengine's environment report: it ran on the GPU
    assert 'Iter(train) [3/3]' in out, out[-3000:]
    assert osp.isfile(osp.join(work, 'iter_3.pth')), out[-2000:]
    test_dir = str(tmp_path / 'test')
    rc, out = run([sys.executable, osp.join(MMDET_TOOLS, 'test.py'), config, osp.join(work, 'iter_3.pth'),
                   '--work-dir', test_dir, '--cfg-options'] + options(), timeout=900)
    assert rc == 0, out[-4000:]
    assert 'Average Precision  (AP) @[ IoU=0.50:0.95' in out, out[-3000:]  # pycocotools ran on the predictions
