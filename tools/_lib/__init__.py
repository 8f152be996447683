"""Development code of this repository, not installed: the generators of configs and README tables (:mod:`.docs`,
:mod:`.recipes`), the benchmark harnesses (:mod:`.benchmarks`) and the generated data sets and short runs of the
quick starts (:mod:`.datasets`, :mod:`.quick_train`, :mod:`.synthetic_coco`, :mod:`.quickstart`).

``python tools/x.py`` puts ``tools/`` first on ``sys.path``, so the entry points in ``tools/`` import this
package as ``dev``; the tests find it through ``pythonpath = ["tools"]`` (pyproject.toml). It imports the
installed packages (``timm_lambda``, ``timm_lambda_mmdet``), never the other way round (tests/test_layout.py).
"""
