"""Facts from the LambdaNetworks paper (Bello, ICLR 2021) that the models, configs, README and tests use.

Each table is written down here once; everything else reads it from here.
"""
__all__ = ['STAGE_DEPTHS', 'LAMBDA_BLOCKS', 'RESOLUTIONS', 'RESOLUTIONS_C4', 'PARAM_COUNTS', 'TABLE18_TOP1', 'TABLE20',
           'TABLE3_TOP1', 'TABLE14']

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

# Parameter counts (millions) the paper reports, with the table that reports them.
PARAM_COUNTS = {
    'lambdaresnet101': (36.9, 'Table 13'),
    'lambdaresnet152': (51.4, 'Table 13'),
    'lambdaresnet101_c4': (26.0, 'Table 13'),
    'lambdaresnet152_c4': (35.1, 'Tables 13, 15'),
    'lambdaresnet200_c4': (42.0, 'Table 15'),
    'resnet50_lambda': (15.0, 'Table 3'),
    'resnet50_lambda_u4': (16.0, 'Table 3'),
    'resnetrs101_nose': (44.6, 'Table 13'),
    'resnetrs152_nose': (60.2, 'Table 13'),
    'resnetrs101': (63.6, 'Table 13'),
    'mobilenetv2_100_lambda': (3.21, 'Table 17'),
}

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

# Table 3: ImageNet top-1 (%) of the ResNet-50 rows trained with the 90-epoch setup.
TABLE3_TOP1 = {'Lambda layer': 78.4, 'Lambda layer (|u|=4)': 78.9}

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
