"""The code of the programs in ``tools/`` (not installed): the generators of the committed configs and doc tables
(:mod:`.docs`, :mod:`.recipes`, :mod:`.results`), and the generated data sets and short runs of the quick starts
(:mod:`.datasets`, :mod:`.quick_train`, :mod:`.synthetic_coco`, :mod:`.quickstart`).

``python tools/x.py`` puts ``tools/`` first on ``sys.path``, so the programs in ``tools/`` import this package as
``_lib``; the tests find it through ``pythonpath`` (pyproject.toml). It imports the installed packages
(``timm_lambda``, ``timm_lambda_mmdet``), never the other way round, and not the lab (``benchmarks/``;
tests/test_layout.py).
"""
