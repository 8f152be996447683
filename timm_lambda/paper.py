"""Facts from the LambdaNetworks paper (Bello, ICLR 2021), the AA paper it compares with and the CIFAR-10
reproduction report, which the models, configs, README and tests use.

Only facts: each is written down here once; everything else reads it from here (the two lookups below,
``TABLE3_TOP1`` and ``PARAM_COUNTS``' Table 3 entries, read the tables rather than repeat them).
"""
__all__ = ['STAGE_DEPTHS', 'LAMBDA_BLOCKS', 'RESOLUTIONS', 'RESOLUTIONS_C4', 'TABLE3', 'TABLE3_TOP1', 'TABLE4',
           'TABLE14', 'COCO_SETUP', 'TABLE18_TOP1', 'TABLE20', 'AA_TABLE3', 'AA_TABLE6', 'PARAM_COUNTS', 'FLOPS',
           'CIFAR10_REPORT',
           'CIFAR10_MEAN', 'CIFAR10_STD']

# Table 19: blocks per stage c2..c5 (He et al. 2016; ResNet-RS depths).
STAGE_DEPTHS = {
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
    200: (3, 24, 36, 3),
    270: (4, 29, 53, 4),
    350: (4, 36, 72, 4),
    420: (4, 44, 87, 4),
}

# Table 19: 1-based numbers of the c4 blocks that use a lambda layer; every c5 block does too.
LAMBDA_BLOCKS = {
    50: (3,),
    101: (6, 12, 18),
    152: (5, 10, 15, 20, 25, 30),
    200: (5, 10, 15, 20, 25, 30),
    270: (8, 16, 24, 32, 40, 48),
    350: (10, 20, 30, 40, 50, 60),
    420: (10, 20, 30, 40, 50, 60, 70, 80),
}

# Table 18 / Table 20: train (= test, F.1) resolutions per depth; the first is the default.
# LambdaResNet-200 is not in Table 18: 256 (as -270 and ResNet-RS-200) is our choice.
RESOLUTIONS = {50: (160, 128), 101: (192, 160), 152: (256, 224, 192, 288), 200: (256,), 270: (256,),
               350: (320, 288, 256), 420: (320,)}
# -C4 variants: Table 13 (101-C4 at 224, 152-C4 at 256), Table 15 (152/200-C4 at 320), Table 16 (270-C4 at 256).
RESOLUTIONS_C4 = {50: (160,), 101: (224, 192), 152: (256, 320), 200: (320,), 270: (256,), 350: (320,), 420: (320,)}

# Table 18: supervised ImageNet top-1 (%) per (depth, image size); 152 at 288 has pseudo-label results only.
TABLE18_TOP1 = {(50, 128): 77.4, (50, 160): 79.2, (101, 160): 80.8, (101, 192): 81.9, (152, 192): 82.5,
                (152, 224): 83.2, (152, 256): 83.8, (270, 256): 84.2, (350, 256): 84.4, (350, 288): 84.5,
                (350, 320): 84.7, (420, 320): 84.9}

# Table 20: 350-epoch hyper-parameters per (depth, image size): RandAugment magnitude, dropout, stochastic depth.
TABLE20 = {(50, 128): (10, 0.2, 0.0), (50, 160): (10, 0.2, 0.0), (101, 160): (10, 0.3, 0.0),
           (101, 192): (15, 0.2, 0.0), (152, 192): (15, 0.3, 0.0), (152, 224): (15, 0.3, 0.1),
           (152, 256): (15, 0.3, 0.1), (152, 288): (15, 0.3, 0.1), (270, 256): (15, 0.3, 0.1),
           (350, 256): (15, 0.3, 0.2), (350, 288): (15, 0.3, 0.2), (350, 320): (15, 0.3, 0.2),
           (420, 320): (15, 0.3, 0.2)}

# Appendix F.3 "COCO object detection": the training setup of Table 14 (configs/mmdet/_base_ spells it out).
COCO_SETUP = dict(image_size=1024, steps=130_000, batch_size=256, hardware='128 TPUv3 cores')

# Table 14: Mask R-CNN on COCO at 1024x1024 from scratch: (row, timm backbone, box AP, box AP_s/m/l, mask AP,
# mask AP_s/m/l). "ResNet" rows are ResNet-RS without SE (resnetrs*_nose), "+ SE" rows timm's resnetrs*.
TABLE14 = [
    ('ResNet-101', 'resnetrs101_nose', 48.2, (29.9, 50.9, 64.9), 42.6, (24.2, 45.6, 60.0)),
    ('ResNet-101 + SE', 'resnetrs101', 48.5, (29.9, 51.5, 65.3), 42.8, (24.0, 46.0, 60.2)),
    ('LambdaResNet-101', 'lambdaresnet101', 49.4, (31.7, 52.2, 65.6), 43.5, (25.9, 46.5, 60.8)),
    ('ResNet-152', 'resnetrs152_nose', 48.9, (29.9, 51.8, 66.0), 43.2, (24.2, 46.1, 61.2)),
    ('ResNet-152 + SE', 'resnetrs152', 49.4, (30.0, 52.3, 66.7), 43.5, (24.6, 46.8, 61.8)),
    ('LambdaResNet-152', 'lambdaresnet152', 50.0, (31.8, 53.4, 67.0), 43.9, (25.5, 47.3, 62.0)),
]

# --- Attention baselines (README "Attention baselines (Tables 3 and 4)") ----------------------------------
# Attention Augmented Convolutional Networks (Bello, Zoph, Vaswani, Shlens, Le; ICCV 2019), "AA paper" below.

# AA paper Table 3: parameter counts (millions) of the ResNets and their attention augmented versions
# (kappa = 2 upsilon = 0.2, except ResNet-34: kappa = upsilon = 0.25; 8 heads; c3-c5 augmented).
AA_TABLE3 = {
    34: dict(resnet=21.8, se=22.0, aa=20.7),
    50: dict(resnet=25.6, se=28.1, aa=25.8),
    101: dict(resnet=44.5, se=49.3, aa=45.4),
    152: dict(resnet=60.2, se=66.8, aa=61.6),
}
# AA paper Table 6: AA-ResNet-50 with kappa = upsilon = ratio -> parameters (millions).
AA_TABLE6 = {0.25: 24.3, 0.5: 22.3, 0.75: 20.7, 1.0: 19.4}

# LambdaNetworks Table 3 (ResNet-50, ImageNet, 224 px): layer, parameters (millions, None: not given), top-1.
TABLE3 = [
    ('Conv (He et al., 2016)', 25.6, 76.9),
    ('Conv + channel attention (Hu et al., 2018)', 28.1, 77.6),
    ('Conv + linear attention (Chen et al., 2018)', 33.0, 77.0),
    ('Conv + linear attention (Shen et al., 2018)', None, 77.3),
    ('Conv + relative self-attention (Bello et al., 2019)', 25.8, 77.7),
    ('Local relative self-attention (Ramachandran et al., 2019)', 18.0, 77.4),
    ('Local relative self-attention (Hu et al., 2019)', 23.3, 77.3),
    ('Local relative self-attention (Zhao et al., 2020)', 20.5, 78.2),
    ('Lambda layer', 15.0, 78.4),
    ('Lambda layer (|u|=4)', 16.0, 78.9),
]

# LambdaNetworks Table 4 (ResNet-50 at 224 px): layer, space complexity, memory in GB (batch 128, float32;
# None: '-'), inference throughput on 8 TPUv3 cores in examples/s (None: OOM), top-1 (None: OOM).
# b: batch, h: heads, n: input length, m: context length, k: query/key depth, l: number of layers.
TABLE4 = [
    ('Global self-attention', 'Θ(blhm²)', 120.0, None, None),
    ('Axial self-attention', 'Θ(blhn√n)', 4.8, 960, 77.5),
    ('Local self-attention (7x7)', 'Θ(blhnm)', None, 440, 77.4),
    ('Lambda layer', 'Θ(lkn²)', 1.9, 1160, 78.4),
    ('Lambda layer (|k|=8)', 'Θ(lkn²)', 0.95, 1640, 77.9),
    ('Lambda layer (shared embeddings)', 'Θ(kn²)', 0.63, 1210, 78.0),
    ('Lambda convolution (7x7)', 'Θ(lknm)', None, 1100, 78.1),
]

# Table 3 top-1 by row (the recipes cite it)
TABLE3_TOP1 = {layer: top1 for layer, _, top1 in TABLE3}
_TABLE3_PARAMS = {layer: params for layer, params, _ in TABLE3}

# Parameter counts (millions) the papers report, with the table that reports them, by the model that builds that
# row (tests/test_models.py checks every entry within 2%). Counts of Table 3 and AA Table 3 are read from there.
PARAM_COUNTS = {
    'lambdaresnet101': (36.9, 'Table 13'),
    'lambdaresnet152': (51.4, 'Table 13'),
    'lambdaresnet101_c4': (26.0, 'Table 13'),
    'lambdaresnet152_c4': (35.1, 'Tables 13, 15'),
    'lambdaresnet200_c4': (42.0, 'Table 15'),
    'resnet50_lambda': (_TABLE3_PARAMS['Lambda layer'], 'Table 3'),
    'resnet50_lambda_u4': (_TABLE3_PARAMS['Lambda layer (|u|=4)'], 'Table 3'),
    'resnetrs101_nose': (44.6, 'Table 13'),
    'resnetrs152_nose': (60.2, 'Table 13'),
    'resnetrs101': (63.6, 'Table 13'),
    'mobilenetv2_100_lambda': (3.21, 'Table 17'),
    'seresnet50': (_TABLE3_PARAMS['Conv + channel attention (Hu et al., 2018)'], 'Table 3'),
    'resnet50_local_attn7': (_TABLE3_PARAMS['Local relative self-attention (Ramachandran et al., 2019)'], 'Table 3'),
    **{f'aa_resnet{depth}': (counts['aa'], 'AA Table 3') for depth, counts in AA_TABLE3.items()},
}

# FLOPs (billions, one 224 px image) the papers report, with the table, by the model that builds that row
# (tests/test_paper_facts.py reads them from the tables). Table 9's content + position row is Table 3's lambda
# layer model (78.4% top-1; 14.9M there, 15.0M in Table 3); Table 17 gives 563 M. Both papers count a multiply-add
# as two FLOPs: the MobileNet-v2 baseline of Table 17 (603 M) is twice the 300 M multiply-adds of Sandler et al.,
# the ResNet-50 of AA Table 3 (8.2 G) twice its 4.1 G (tests/test_flops.py).
# Not here: Table 10 (ResNet-50 with lambda layers in c4 and c5 only) and Table 16 (LambdaResNet-270-C4 with
# 7x7 scopes) are models this package does not register.
FLOPS = {
    'resnet50_lambda': (12.0, 'Table 9'),
    'mobilenetv2_100_lambda': (0.563, 'Table 17'),
    'aa_resnet34': (7.1, 'AA Table 3'),
    'aa_resnet50': (8.3, 'AA Table 3'),
    'aa_resnet101': (16.1, 'AA Table 3'),
    'aa_resnet152': (23.8, 'AA Table 3'),
}

# The seed CIFAR-10 reproduction report ("LambdaNetworks: efficient, accurate, but also accessible? A
# reproducibility project with CIFAR-10", J. I. de Alvear Cardenas and W. A. J. G. de Vries, TU Delft, 2021;
# shared/papers/cifar10_reproduction_report_zh.md, code github.com/joigalcar3/LambdaNetworks at 0b1681d).
# Its model: torchvision's ResNet-50 (7x7 stride-2 stem + max pool) at 32x32 with every bottleneck 3x3 conv
# replaced by a lambda layer (|k|=16, |h|=4, |u|=1, global context: the layers see 8x8, 4x4, 2x2, 1x1), stride
# as 3x3 average pooling (padding 1) after the layer, one position-embedding table per resolution shared by
# the layers at that resolution, 10 classes.
CIFAR10_REPORT = {
    'params_lambda': 12.8,      # millions, section 9.1 ("23.5M and 12.8M")
    'params_resnet50': 23.5,    # millions, torchvision resnet50(num_classes=10)
    'num_classes': 10,
    'input_size': 32,
    'lambda_input_sizes': (8, 4, 2, 1),  # section 5.2: |n| in [8, 4, 2, 1] (per side)
    'dim_k': 16, 'heads': 4,
    # Their 12.8M is torchsummary's count (its code prints summary(model)), which adds up the `weight` and
    # `bias` of every module and so skips the shared embedding tables (an attribute `E` of each layer):
    # 12,828,926. With them (model.parameters(), each shared table once: 64*64*16 + 16*16*16 + 4*4*16 + 1*1*16
    # = 69,904) it is 12,898,830. (Counted from their code at 0b1681d.)
    'params_lambda_torchsummary': 12_828_926,
    'params_lambda_all': 12_898_830,
    'position_embedding_params': 69_904,
    # Training setup (section 6.3, user_input.py, model_preparation.py, main_general.py): 90 epochs, batch 128,
    # Adam (betas 0.9, 0.9999; L2 weight decay 1e-4 on every parameter), initial lr 0.0005 (best of the
    # section 9.3 sweep) x (epoch + 1) for the first 5 epochs, then cosine from 0.0025 to 0 over the last 85,
    # label smoothing 0.1, random 32x32 crop of the 4-pixel zero-padded image + horizontal flip.
    'epochs': 90, 'batch_size': 128, 'lr': 0.0005, 'warmup_epochs': 5, 'weight_decay': 1e-4,
    'betas': (0.9, 0.9999), 'smoothing': 0.1,
    # Result (section 9.1): the lambda model's test accuracy is 3.2 points below ResNet-50's (figures only).
    'accuracy_gap_vs_resnet50': -3.2,
}
# Normalisation the report uses (data_preprocessing.py): the usual CIFAR-10 channel means and the widely
# copied "std" values (the per-pixel standard deviations of CIFAR-10 train are about 0.247, 0.243, 0.261).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)
