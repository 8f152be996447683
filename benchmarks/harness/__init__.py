"""Benchmarks: how speed and memory are measured on a shared machine (:mod:`.measure`) and the runs built on it,
LambdaNetworks Table 4 (:mod:`.table4`); ``tools/benchmark_*.py`` are their command lines."""
