"""The attention baselines of LambdaNetworks Tables 3 and 4: local and axial self-attention against naive
per-query float64 references, the Table 4 set in one ResNet-50 frame, the paper's parameter counts and
memory figures, the benchmark and table tools (smoke runs), the mmdet backbone."""
import math
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F

from _lib.docs import TABLE3_MODELS, table3_rows
from harness.table4 import TABLE4_ROWS, analytic_memory_gib, markdown, plot, run_table4
from timm_lambda import registered_models
from timm_lambda.layers import AxialSelfAttention2d, LambdaLayer, LocalSelfAttention2d, RelPosSelfAttention2d
from timm_lambda.paper import TABLE3, TABLE4

TABLE4_MODELS = [name for name, _, _ in TABLE4_ROWS.values()]
ATTENTION_MODELS = ['aa_resnet34', 'aa_resnet50', 'resnet50_global_attn', 'resnet50_axial_attn',
                    'resnet50_local_attn7']


def naive_local_attention(x, layer):
    """Ramachandran et al.'s local attention as timm's HaloAttn computes it, one query at a time, float64:
    keys/values of the k x k window around the query (zero outside the image), logits
    ``q . k_j / sqrt(d) + q . (r^H[dy] + r^W[dx])``; HaloAttn's tables index offset ``d`` at row
    ``win - 1 + halo + d`` (win = k for one-pixel blocks)."""
    x = x.double()
    B, _, H, W = x.shape
    heads, dk, dv, halo = layer.num_heads, layer.dim_head_qk, layer.dim_head_v, layer.halo_size
    win = 2 * halo + 1
    q = F.conv2d(x, layer.q.weight.double())
    kv = F.pad(F.conv2d(x, layer.kv.weight.double()), [halo] * 4)
    th, tw = layer.pos_embed.height_rel.double(), layer.pos_embed.width_rel.double()
    offsets = torch.arange(-halo, halo + 1)
    rel = th[win - 1 + halo + offsets][:, None] + tw[win - 1 + halo + offsets][None, :]  # [win, win, dk]
    out = torch.zeros(B, heads * dv, H, W, dtype=torch.float64)
    for b in range(B):
        for h in range(heads):
            kvh = kv[b, h * (dk + dv):(h + 1) * (dk + dv)]
            for iy in range(H):
                for ix in range(W):
                    window = kvh[:, iy:iy + win, ix:ix + win]  # padded coordinates: centred on (iy, ix)
                    keys, values = window[:dk].permute(1, 2, 0), window[dk:]
                    qi = q[b, h * dk:(h + 1) * dk, iy, ix]
                    logits = keys @ qi / math.sqrt(dk) + rel @ qi
                    weights = logits.flatten().softmax(0).view(win, win)
                    out[b, h * dv:(h + 1) * dv, iy, ix] = (values * weights).sum((1, 2))
    return out


@pytest.mark.parametrize('kernel_size', [3, 7])
def test_local_attention_matches_naive_reference(kernel_size):
    torch.manual_seed(0)
    layer = LocalSelfAttention2d(6, 8, num_heads=2, kernel_size=kernel_size).double()
    with torch.no_grad():
        layer.pos_embed.height_rel.normal_()
        layer.pos_embed.width_rel.normal_()
    x = torch.randn(2, 6, 6, 9, dtype=torch.float64)
    torch.testing.assert_close(layer(x), naive_local_attention(x, layer), rtol=1e-10, atol=1e-10)
    strided = LocalSelfAttention2d(6, 8, num_heads=2, kernel_size=kernel_size, stride=2).double()
    strided.load_state_dict(layer.state_dict())
    torch.testing.assert_close(strided(x), F.avg_pool2d(layer(x), 3, 2, 1, count_include_pad=False))


def naive_axial_pass(x, attn):
    """Multi-head attention along every row, one query at a time, float64:
    ``softmax_j(q_i . (k_j + r[j - i]) / sqrt(d))`` over the row."""
    B, _, H, W = x.shape
    heads, dk, dv = attn.num_heads, attn.dim_head_qk, attn.dim_head_v
    qkv = F.conv2d(x, attn.qkv.weight.double())
    q, k, v = qkv.split([heads * dk, heads * dk, heads * dv], dim=1)
    r = (attn.rel.shape[0] + 1) // 2
    table = attn.rel.double()
    out = torch.zeros(B, heads * dv, H, W, dtype=torch.float64)
    for b in range(B):
        for h in range(heads):
            for iy in range(H):
                for ix in range(W):
                    qi = q[b, h * dk:(h + 1) * dk, iy, ix]
                    keys = k[b, h * dk:(h + 1) * dk, iy].t() + table[r - 1 - ix:r - 1 - ix + W]  # [W, dk]
                    weights = (keys @ qi / math.sqrt(dk)).softmax(0)
                    out[b, h * dv:(h + 1) * dv, iy, ix] = v[b, h * dv:(h + 1) * dv, iy] @ weights
    return out


def test_axial_attention_matches_naive_reference():
    """A height pass (columns) then a width pass (rows), each against the per-query reference."""
    torch.manual_seed(0)
    layer = AxialSelfAttention2d(6, 8, feat_size=(7, 9), num_heads=2, qk_ratio=0.75).double()
    with torch.no_grad():
        layer.height_attn.rel.normal_()
        layer.width_attn.rel.normal_()
    x = torch.randn(2, 6, 5, 8, dtype=torch.float64)
    mid = naive_axial_pass(x.transpose(2, 3), layer.height_attn).transpose(2, 3)
    torch.testing.assert_close(layer(x), naive_axial_pass(mid, layer.width_attn), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match='img_size'):
        layer(torch.randn(1, 6, 8, 8, dtype=torch.float64))


# --- the Table 4 set: one ResNet-50 frame ---------------------------------------------------------------

MIXER_TYPES = {'resnet50_global_attn': RelPosSelfAttention2d, 'resnet50_axial_attn': AxialSelfAttention2d,
               'resnet50_local_attn7': LocalSelfAttention2d, 'resnet50_lambda': LambdaLayer,
               'resnet50_lambda_k8': LambdaLayer, 'resnet50_lambda_shared': LambdaLayer,
               'resnet50_lambda_conv7': LambdaLayer}


@pytest.mark.parametrize('name', TABLE4_MODELS)
def test_table4_models_share_one_resnet50_frame(name):
    """Registered; vanilla ResNet-50 stem and 3-4-6-3 bottlenecks, every 3x3 convolution replaced."""
    assert name in registered_models()
    model = timm.create_model(name, device='meta')
    assert model.conv1.kernel_size == (7, 7) and isinstance(model.maxpool, torch.nn.MaxPool2d)
    blocks = [b for stage in (model.layer1, model.layer2, model.layer3, model.layer4) for b in stage]
    assert [len(s) for s in (model.layer1, model.layer2, model.layer3, model.layer4)] == [3, 4, 6, 3]
    assert all(isinstance(b.conv2, MIXER_TYPES[name]) for b in blocks)
    assert [b.conv2.stride for b in blocks if b.downsample is not None] == [1, 2, 2, 2]


def test_table4_lambda_variants():
    lam = lambda name: timm.create_model(name, device='meta').layer3[1].conv2  # noqa: E731
    assert lam('resnet50_lambda_k8').dim_k == 8
    assert (lam('resnet50_lambda_conv7').scope, lam('resnet50_lambda_conv7').form) == ((7, 7), 'conv')
    shared = timm.create_model('resnet50_lambda_shared', device='meta')
    tables = {id(m.pos_embedding) for m in shared.modules() if isinstance(m, LambdaLayer)}
    assert len(tables) == 1


def test_table4_analytic_memory_reproduces_the_papers_figures():
    """The paper's memory column from its complexity column (harness.table4 docstring): within rounding."""
    paper = {layer: gb for layer, _, gb, _, _ in TABLE4}
    for layer, (_, _, kind) in TABLE4_ROWS.items():
        if paper[layer] is not None:
            assert analytic_memory_gib(kind) == pytest.approx(paper[layer], rel=0.03), layer
    # footnote 2: one attention layer, 128 64x64 images, 8 heads: 64 GB
    assert analytic_memory_gib('global', depths=(1, 0, 0, 0), img_size=256) == pytest.approx(64)


def test_table3_rows_we_build_match_the_paper():
    rows = table3_rows()
    assert [r['layer'] for r in rows] == [layer for layer, _, _ in TABLE3] == list(TABLE3_MODELS)
    built = [r for r in rows if r['model']]
    assert {r['model'] for r in built} >= {'seresnet50', 'aa_resnet50', 'resnet50_local_attn7', 'resnet50_lambda'}
    for r in built:
        assert r['ours'] == pytest.approx(r['paper'], rel=0.02), r
    assert all(r['note'] for r in rows if not r['model'])


# --- models: arguments, any size, mmdet ---------------------------------------------------------------

@pytest.mark.parametrize('name,kwargs,param', [
    ('resnet50_global_attn', dict(kappa=0.2), 'kappa'),
    ('resnet50_local_attn7', dict(img_size=224), 'img_size'),
    ('resnet50_local_attn7', dict(kernel_size=6), 'kernel_size'),
    ('resnet50_axial_attn', dict(qk_ratio=-1), 'qk_ratio'),
    ('resnet50_global_attn', dict(num_heads=3), 'num_heads'),
])
def test_bad_arguments_name_the_parameter(name, kwargs, param):
    with pytest.raises(ValueError, match=param):
        timm.create_model(name, device='meta', **kwargs)


def test_local_attention_serves_any_size_and_global_refuses_larger_inputs():
    local = timm.create_model('resnet50_local_attn7', layers=(1, 1, 1, 1), num_classes=3).eval()
    glob = timm.create_model('resnet50_global_attn', layers=(1, 1, 1, 1), num_classes=3, img_size=64).eval()
    with torch.no_grad():
        assert local(torch.randn(1, 3, 288, 96)).shape == (1, 3)
        assert glob(torch.randn(1, 3, 64, 33)).shape == (1, 3)
        with pytest.raises(ValueError, match='img_size'):
            glob(torch.randn(1, 3, 96, 64))


@pytest.mark.parametrize('name', ATTENTION_MODELS)
def test_mmdet_backbone(name):
    """timm_lambda_mmdet.TimmLambdaResNet(model_name=...): c2..c5 at strides 4..32 (one block per stage)."""
    import _det  # noqa: F401  (skips without the [det] extra; before any mmdet import)
    # isort: split
    from mmdet.registry import MODELS

    import timm_lambda_mmdet  # noqa: F401  (registers TimmLambdaResNet)
    backbone = MODELS.build(dict(type='TimmLambdaResNet', model_name=name, norm_cfg=dict(type='BN'),
                                 model_kwargs=dict(layers=(1, 1, 1, 1)))).train()
    outs = backbone(torch.randn(2, 3, 64, 96))
    width = 1 if name == 'aa_resnet34' else 4
    assert [tuple(o.shape) for o in outs] == [(2, 64 * width * 2 ** i, 16 // 2 ** i, 24 // 2 ** i) for i in range(4)]
    sum(o.mean() for o in outs).backward()


# --- the tools ---------------------------------------------------------------------------------------

def test_table4_benchmark_smoke(tmp_path):
    """A run at 32 px, batch 2, one block per stage: every row measured, ratios to the lambda layer; a row over
    max_gib is not run."""
    result = run_table4(batch=2, img_size=32, repeats=1, warmup=0, model_kwargs=dict(layers=(1, 1, 1, 1)),
                        log=lambda *a: None)
    rows = {r['layer']: r for r in result['rows']}
    assert list(rows) == list(TABLE4_ROWS)
    assert rows['Lambda layer']['train_ratio'] == 1.0
    assert all(r['measured_gib'] > 0 and r['train_s'] > 0 and r['infer_s'] > 0 for r in rows.values())
    assert rows['Axial self-attention']['paper_ratio'] == pytest.approx(1160 / 960)
    table = markdown(result)
    assert 'Lambda layer (\\|k\\|=8)' in table and 'OOM' in table
    plot(result, str(tmp_path / 't4.png'))
    assert (tmp_path / 't4.png').stat().st_size > 10000
    skipped = run_table4(batch=2, img_size=32, repeats=1, warmup=0, max_gib=0.001, infer=False,
                         rows=['Global self-attention'], model_kwargs=dict(layers=(1, 1, 1, 1)),
                         log=lambda *a: None)
    glob = skipped['rows'][0]
    assert glob['measured_gib'] is None and glob['train_s'] is None
    assert 'not run' in markdown(skipped)


def test_benchmark_and_table_tools_run(tmp_path):
    import subprocess
    import sys
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / 'benchmarks' / 'benchmark_table4.py'), '--img-size', '32',
                           '--batch', '2', '--repeats', '1', '--no-infer', '--rows', 'Lambda layer',
                           '--md', str(tmp_path / 't.md'), '--png', ''],
                          cwd=repo, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert '| Lambda layer | `resnet50_lambda` | Θ(lkn²) | 1.9 | 1.92 |' in (tmp_path / 't.md').read_text()
    from _lib.docs import attention_tables
    out = attention_tables()
    assert 'Local relative self-attention (Ramachandran et al., 2019) | 18.0 |' in out
    assert '`aa_resnet152` | 61.6 | 61.61' in out


@pytest.mark.parametrize('name', ATTENTION_MODELS)
def test_fx_torchscript_and_trace_are_right_at_every_size(name):
    """An FX graph, a scripted model and a jit.trace made at 64 px give the eager result at other sizes
    (the size logic of the relative tables and the upsampling runs at call time)."""
    import warnings
    torch.manual_seed(0)
    with timm.layers.set_layer_config(scriptable=True):
        model = timm.create_model(name, layers=(1, 1, 1, 1), num_classes=3).eval()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        traced = torch.jit.trace(model, torch.randn(1, 3, 64, 64), check_trace=False)
    graphs = {'fx': torch.fx.symbolic_trace(model), 'script': torch.jit.script(model), 'trace': traced}
    for size in ((64, 64), (96, 128)):
        x = torch.randn(1, 3, *size)
        with torch.no_grad():
            ref = model(x)
            for kind, graph in graphs.items():
                torch.testing.assert_close(graph(x), ref, rtol=1e-5, atol=1e-5, msg=f'{kind} at {size}')
