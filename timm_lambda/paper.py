"""Facts from the LambdaNetworks paper (Bello, ICLR 2021) that the models, configs, README and tests use.

Each table is written down here once; everything else reads it from here.
"""
__all__ = ['STAGE_DEPTHS', 'LAMBDA_BLOCKS', 'RESOLUTIONS', 'RESOLUTIONS_C4', 'PARAM_COUNTS']

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
