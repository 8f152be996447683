"""The lab's shared code (not installed): how speed and memory are measured on a shared machine and the commit and
machine every result names (:mod:`.measure`), the CPU's float32 limit (:mod:`.peak`), LambdaNetworks Table 4
(:mod:`.table4`); ``benchmarks/*.py`` are the programs (``python benchmarks/x.py`` finds this package as
``harness``)."""
