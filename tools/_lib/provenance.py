"""The commit, CPU, machine and load that every committed result names, for the programs in ``tools/`` that write
results (the GPU check, the quick runs): benchmarks/harness/measure.py's helpers, read from that file, so that one
``commit()`` names every result (tests/test_result_commits.py). ``python tools/x.py`` has ``tools/`` on its path, not
``benchmarks/``, hence the file.
"""
import importlib.util
from pathlib import Path

__all__ = ['commit', 'cpu_model', 'load_average', 'machine', 'MEASURE']

MEASURE = Path(__file__).resolve().parents[2] / 'benchmarks' / 'harness' / 'measure.py'
_spec = importlib.util.spec_from_file_location('harness_measure', MEASURE)
_measure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_measure)
commit, cpu_model, load_average, machine = _measure.commit, _measure.cpu_model, _measure.load_average, _measure.machine
