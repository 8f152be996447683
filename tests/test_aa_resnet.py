"""AA-ResNets (Attention Augmented Convolutional Networks, Bello et al. 2019): the 2-D relative logits and the
augmented convolution against naive per-query float64 references, parameter counts against the AA paper's
Tables 3 and 6, layout, arguments. timm's model suite covers the registered models (tests/test_timm_suite.py)."""
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from _lib.docs import count_params
from timm_lambda.layers import AugmentedConv2d, RelPosSelfAttention2d
from timm_lambda.layers.attention_augmented import augmented_depths
from timm_lambda.layers.relative_attention import rel_to_abs, relative_logits_1d
from timm_lambda.paper import AA_TABLE3, AA_TABLE6

TINY = dict(layers=(1, 1, 1, 1), num_classes=5)


def naive_relative_attention(x, qkv_weight, table_h, table_w, heads, dk, dv):
    """AA eq. 3-4, one query at a time, float64: ``O_h(i) = sum_j softmax_j(l_ij) v_j`` with
    ``l_ij = q_i . (k_j + r^H[j_y - i_y] + r^W[j_x - i_x]) / sqrt(dk)``; table row ``R - 1`` is offset 0."""
    x = x.double()
    B, _, H, W = x.shape
    qkv = torch.einsum('oc,bchw->bohw', qkv_weight.double().flatten(1), x)
    q, k, v = qkv.split([heads * dk, heads * dk, heads * dv], dim=1)
    rh, rw = (table_h.shape[0] + 1) // 2, (table_w.shape[0] + 1) // 2
    th, tw = table_h.double(), table_w.double()
    out = torch.zeros(B, heads * dv, H, W, dtype=torch.float64)
    for b in range(B):
        for h in range(heads):
            qh, kh, vh = q[b, h * dk:(h + 1) * dk], k[b, h * dk:(h + 1) * dk], v[b, h * dv:(h + 1) * dv]
            for iy in range(H):
                for ix in range(W):
                    rel = th[rh - 1 - iy:rh - 1 - iy + H][:, None, :] + tw[rw - 1 - ix:rw - 1 - ix + W][None, :, :]
                    keys = kh.permute(1, 2, 0) + rel  # [H, W, dk]: k_j + r^H[j_y - i_y] + r^W[j_x - i_x]
                    logits = keys @ qh[:, iy, ix] / math.sqrt(dk)
                    weights = logits.flatten().softmax(0).view(H, W)
                    out[b, h * dv:(h + 1) * dv, iy, ix] = (vh * weights).sum((1, 2))
    return out


def test_rel_to_abs_and_relative_logits_1d_match_per_query_reference():
    torch.manual_seed(0)
    for length in (1, 2, 5, 8):
        q = torch.randn(2, 3, length, 4, dtype=torch.float64)
        rel = torch.randn(2 * length - 1, 4, dtype=torch.float64)
        out = relative_logits_1d(q, rel)
        ref = torch.empty(2, 3, length, length, dtype=torch.float64)
        for i in range(length):
            for j in range(length):
                ref[:, :, i, j] = q[:, :, i] @ rel[j - i + length - 1]
        torch.testing.assert_close(out, ref)
        x = torch.randn(4, length, 2 * length - 1)
        idx = torch.arange(length)
        assert torch.equal(rel_to_abs(x), x[:, idx[:, None], idx[None, :] - idx[:, None] + length - 1])


@pytest.mark.parametrize('size', [(5, 7), (7, 9), (1, 4), (6, 3)], ids=str)
def test_relative_attention_matches_naive_reference(size):
    """Every query of RelPosSelfAttention2d against eq. 3-4, with tables for 7x9 inputs (cropped for smaller)."""
    torch.manual_seed(0)
    layer = RelPosSelfAttention2d(6, 8, feat_size=(7, 9), num_heads=2, dim_head=3).double()
    with torch.no_grad():  # non-trivial position tables
        layer.pos_embed.height_rel.normal_()
        layer.pos_embed.width_rel.normal_()
    x = torch.randn(2, 6, *size, dtype=torch.float64)
    ref = naive_relative_attention(x, layer.qkv.weight, layer.pos_embed.height_rel, layer.pos_embed.width_rel,
                                   heads=2, dk=3, dv=4)
    torch.testing.assert_close(layer(x), ref, rtol=1e-10, atol=1e-10)


def test_relative_attention_is_timms_bottleneck_attn_at_its_size():
    """At timm's one accepted size, our forward equals timm's BottleneckAttn (scale_pos_embed=True) with the
    same parameters: the layer is BottleneckAttn, sized up to feat_size."""
    from timm.layers.bottleneck_attn import BottleneckAttn
    torch.manual_seed(0)
    ours = RelPosSelfAttention2d(16, 16, feat_size=(6, 5), num_heads=4).eval()
    theirs = BottleneckAttn(16, 16, feat_size=(6, 5), num_heads=4, scale_pos_embed=True).eval()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 16, 6, 5)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)


def test_relative_attention_refuses_inputs_larger_than_its_tables():
    layer = RelPosSelfAttention2d(8, 8, feat_size=(4, 6), num_heads=2)
    layer(torch.randn(1, 8, 4, 6))
    with pytest.raises(ValueError, match='img_size'):
        layer(torch.randn(1, 8, 5, 6))
    with pytest.raises(ValueError, match='img_size'):
        layer(torch.randn(1, 8, 4, 7))


def _pool(x):
    return F.avg_pool2d(x, 3, 2, 1, count_include_pad=False)


@pytest.mark.parametrize('stride,downsample', [(1, False), (2, False), (1, True), (2, True)])
def test_augmented_conv_matches_reference(stride, downsample):
    """Concat[Conv(X), W^O MHA(X)]: the conv part with F_out - d_v filters, then the projected attention
    (on the input pooled to the output resolution; pooled again and upsampled when downsampled)."""
    torch.manual_seed(0)
    layer = AugmentedConv2d(12, 32, stride=stride, kappa=0.25, upsilon=0.5, heads=2, min_dim_head_k=1,
                            max_size=(11, 9), attn_downsample=downsample).double()
    assert (layer.dim_k, layer.dim_v, layer.conv.out_channels) == (8, 16, 16)
    x = torch.randn(2, 12, 11, 9, dtype=torch.float64)
    a = _pool(x) if stride == 2 else x
    attn_in = _pool(a) if downsample else a
    attn = naive_relative_attention(attn_in, layer.attn.qkv.weight, layer.attn.pos_embed.height_rel,
                                    layer.attn.pos_embed.width_rel, heads=2, dk=4, dv=8)
    attn = F.conv2d(attn, layer.proj.weight)
    if downsample:
        attn = F.interpolate(attn, size=a.shape[-2:], mode='bilinear', align_corners=False)
    ref = torch.cat([F.conv2d(x, layer.conv.weight, stride=stride, padding=1), attn], dim=1)
    out = layer(x)
    assert out.shape == (2, 32, math.ceil(11 / stride), math.ceil(9 / stride))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_fully_attentional_layer_has_no_convolution():
    layer = AugmentedConv2d(16, 16, kappa=1.0, upsilon=1.0, heads=4, max_size=6)
    assert layer.conv is None and layer.dim_v == 16
    assert layer(torch.randn(1, 16, 6, 5)).shape == (1, 16, 6, 5)


def test_depths_per_head():
    """d_v^h = floor(upsilon F / N_h), d_k^h = max(20, floor(kappa F / N_h)) (module docstring)."""
    assert augmented_depths(128, 0.2, 0.1, 8) == (20, 1)
    assert augmented_depths(256, 0.2, 0.1, 8) == (20, 3)
    assert augmented_depths(512, 0.2, 0.1, 8) == (20, 6)
    assert augmented_depths(512, 0.75, 0.75, 8) == (48, 48)
    assert augmented_depths(64, 0.25, 0.25, 8, min_dim_head_k=1) == (2, 2)


# --- parameter counts: AA paper Tables 3 and 6 -----------------------------------------------------------

@pytest.mark.parametrize('depth', sorted(AA_TABLE3))
def test_aa_resnets_match_table3(depth):
    counts = AA_TABLE3[depth]
    assert count_params(f'aa_resnet{depth}') == pytest.approx(counts['aa'], rel=0.02)
    assert count_params(f'resnet{depth}') == pytest.approx(counts['resnet'], rel=0.02)  # the same frame


@pytest.mark.parametrize('ratio', sorted(AA_TABLE6))
def test_aa_resnet50_ratios_match_table6(ratio):
    assert count_params('aa_resnet50', kappa=ratio, upsilon=ratio) == pytest.approx(AA_TABLE6[ratio], rel=0.02)


def test_the_minimum_key_depth_is_what_reproduces_the_counts():
    """Without the 20-dimension minimum per key head, AA-ResNet-50 is 2.6% below Table 3 (25.1M vs 25.8M)."""
    assert count_params('aa_resnet50', min_dim_head_k=1) == pytest.approx(25.1, abs=0.05)
    assert abs(count_params('aa_resnet50', min_dim_head_k=1) / AA_TABLE3[50]['aa'] - 1) > 0.02


# --- layout -------------------------------------------------------------------------------------------

def test_aa_resnet50_layout_and_attention_sizes():
    """Every c3-c5 bottleneck augmented, c2 plain; attention at 14x14 in c3 (downsampled) and c4, 7x7 in c5
    at 224 px (AA paper Table 9); kappa, upsilon, num_heads reach every layer."""
    model = timm.create_model('aa_resnet50', device='meta', num_heads=4, kappa=0.5, upsilon=0.25)
    assert not any(isinstance(m, AugmentedConv2d) for m in model.layer1.modules())
    for stage, size in ((model.layer2, 14), (model.layer3, 14), (model.layer4, 7)):
        for block in stage:
            aa = block.conv2
            assert isinstance(aa, AugmentedConv2d)
            assert (aa.num_heads, aa.kappa, aa.upsilon) == (4, 0.5, 0.25)
            assert aa.attn.feat_size == (size, size)
            assert aa.attn_downsample == (stage is model.layer2)
            assert aa.dim_v == 4 * math.floor(0.25 * aa.dim_out / 4)
    assert [b.conv2.stride for b in model.layer3] == [2, 1, 1, 1, 1, 1]


def test_aa_resnet34_augments_the_first_conv_of_basic_blocks():
    model = timm.create_model('aa_resnet34', device='meta')
    for stage in (model.layer2, model.layer3, model.layer4):
        for block in stage:
            assert isinstance(block.conv1, AugmentedConv2d) and isinstance(block.conv2, nn.Conv2d)
            assert block.conv1.kappa == block.conv1.upsilon == 0.25
    assert not any(isinstance(m, AugmentedConv2d) for m in model.layer1.modules())


def test_img_size_sizes_the_tables():
    model = timm.create_model('aa_resnet50', img_size=(256, 192), **TINY).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 256, 192)).shape == (1, 5)
        with pytest.raises(ValueError, match='img_size'):
            model(torch.randn(1, 3, 288, 192))
    with torch.no_grad():
        assert timm.create_model('aa_resnet50', **TINY).eval()(torch.randn(1, 3, 224, 160)).shape == (1, 5)


def test_training_step_and_factory_kwargs():
    """bfloat16 creation and a backward in bfloat16; norm_layer reaches every norm."""
    model = timm.create_model('aa_resnet50', dtype=torch.bfloat16, **TINY)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    out = model(torch.randn(2, 3, 64, 64, dtype=torch.bfloat16))
    out.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    model = timm.create_model('aa_resnet34', norm_layer=nn.SyncBatchNorm, bn_eps=1e-3, **TINY)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms and all(isinstance(m, nn.SyncBatchNorm) and m.eps == 1e-3 for m in norms)


@pytest.mark.parametrize('kwargs,name', [
    (dict(kappa=0), 'kappa'),
    (dict(kappa=True), 'kappa'),
    (dict(upsilon=1.5), 'upsilon'),
    (dict(upsilon=0.01), 'upsilon'),  # fewer value channels than heads
    (dict(num_heads=0), 'num_heads'),
    (dict(min_dim_head_k=0), 'min_dim_head_k'),
    (dict(attn_downsample='yes'), 'attn_downsample'),
    (dict(img_size=(224, 0)), 'img_size'),
    (dict(qk_ratio=0.5), 'qk_ratio'),
    (dict(kernel_size=7), 'kernel_size'),
    (dict(attn_stages=(1, 4)), 'attn_stages'),
    (dict(block='wide'), 'block'),
    (dict(attention='dense'), 'attention'),
])
def test_bad_arguments_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        timm.create_model('aa_resnet50', device='meta', **kwargs)


@pytest.mark.parametrize('size', ['max_size', 'feat_size'])  # feat_size: max_size's deprecated name
@pytest.mark.parametrize('kwargs,name', [
    (dict(stride=3), 'stride'),
    (dict(kernel_size=2), 'kernel_size'),
    (dict(SIZE=None), 'SIZE'),
    (dict(upsilon=0), 'upsilon'),
])
def test_layer_arguments_name_the_parameter(kwargs, name, size):
    kwargs = {size if k == 'SIZE' else k: v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=size if name == 'SIZE' else name):
        AugmentedConv2d(16, 32, **{size: 8, **kwargs})


@pytest.mark.parametrize('heads', ['heads', 'num_heads'])  # num_heads: heads' deprecated name
def test_layer_heads_argument_names_the_parameter(heads):
    with pytest.raises(ValueError, match=heads):
        AugmentedConv2d(16, 32, max_size=8, **{heads: 0})


def test_layer_old_argument_names_still_work_with_a_deprecation_warning():
    """AugmentedConv2d's heads / max_size are LambdaLayer's names; num_heads / feat_size (timm's, and ours
    before) build the same layer, with a DeprecationWarning each; giving both names is an error."""
    torch.manual_seed(0)
    new = AugmentedConv2d(16, 32, upsilon=0.5, heads=4, max_size=(6, 5))
    torch.manual_seed(0)
    with pytest.warns(DeprecationWarning) as caught:
        old = AugmentedConv2d(16, 32, upsilon=0.5, num_heads=4, feat_size=(6, 5))
    assert sorted(str(w.message).split('(')[1].split('=')[0] for w in caught) == ['feat_size', 'num_heads']
    assert (old.heads, old.num_heads, old.attn.feat_size) == (new.heads, new.num_heads, new.attn.feat_size) == (
        4, 4, (6, 5))
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values()))
    with pytest.raises(TypeError, match='num_heads'):
        AugmentedConv2d(16, 32, upsilon=0.5, heads=2, num_heads=4, max_size=6)
