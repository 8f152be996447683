"""Checks of the installation: packaging, the timm autoload hook, the [det]
extra (mmcv with compiled ops, mmdet version checks) and constraints.txt.

Everything that is about *the installed package* runs in a subprocess with a
temporary working directory, so it sees site-packages and not the source tree.

The [det] tests are skipped when the detection stack is not installed (a
plain ``pip install timm-lambda``), unless TIMM_LAMBDA_REQUIRE_DET=1 (set by
.ci/run), in which case they run and fail.
"""
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from timm_lambda._env import env

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints.txt"
DET_DISTS = ("mmcv", "mmengine", "mmdet", "pycocotools")
CORE_DISTS = ("torch", "torchvision", "timm")
# build tooling pinned for tools/install.sh and the mmcv build; a venv may hold other versions
BUILD_TOOLS = ("pip", "setuptools", "wheel", "ninja")
INSTALL_HINT = 'pip install "timm-lambda[det]"'


def _installed(dist):
    try:
        md.distribution(dist)
    except md.PackageNotFoundError:
        return False
    return True


HAVE_DET = all(_installed(d) for d in DET_DISTS)
REQUIRE_DET = env("TIMM_LAMBDA_REQUIRE_DET")
requires_det = pytest.mark.skipif(
    not (HAVE_DET or REQUIRE_DET),
    reason=f"detection extra not installed ({INSTALL_HINT}); set TIMM_LAMBDA_REQUIRE_DET=1 to fail instead",
)


def run_py(code, tmp_path, env_extra=None, args=(), check=True):
    """Run ``code`` in a fresh interpreter (same Python as pytest) in tmp_path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TIMM_LAMBDA_NO_AUTOLOAD")}
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, *args, "-c", textwrap.dedent(code)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"subprocess failed (rc={proc.returncode})\n--- code ---\n{textwrap.dedent(code)}"
            f"\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
    return proc


def test_distribution_is_installed():
    assert _installed("timm-lambda"), (
        f"timm-lambda is not installed in {sys.executable}; run `bash tools/install.sh` "
        "(or `pip install -c constraints.txt '.[det,test]'`) first"
    )


# --------------------------------------------------------------------------
# timm autoload hook (timm_lambda_autoload.pth + timm_lambda_autoload.py)
# --------------------------------------------------------------------------
def test_import_timm_registers_lambdaresnet(tmp_path):
    proc = run_py(
        """
        import sys
        import timm
        print("timm_lambda" in sys.modules, "lambdaresnet101" in timm.list_models())
        """,
        tmp_path,
    )
    assert proc.stdout.split() == ["True", "True"], (
        "`import timm` must import timm_lambda and register lambdaresnet101 "
        f"(stdout={proc.stdout!r}, stderr={proc.stderr[-2000:]!r})"
    )
    assert "timm-lambda:" not in proc.stderr, proc.stderr


def test_startup_does_not_import_torch(tmp_path):
    proc = run_py(
        "import sys; print('torch' in sys.modules, 'timm' in sys.modules, "
        "'timm_lambda_autoload' in sys.modules)",
        tmp_path,
    )
    torch_loaded, timm_loaded, hook_loaded = proc.stdout.split()
    assert torch_loaded == "False", "a bare `python` start-up must not import torch"
    assert timm_loaded == "False", "a bare `python` start-up must not import timm"
    assert hook_loaded == "True", (
        "timm_lambda_autoload.pth was not processed at start-up: is it in site-packages? "
        "(reinstall with `pip install .`)"
    )


def test_autoload_pth_is_recorded_in_the_distribution():
    # recorded => installed into site-packages by pip and removed again by `pip uninstall`
    files = [str(f) for f in (md.distribution("timm-lambda").files or [])]
    assert "timm_lambda_autoload.pth" in files, (
        "timm_lambda_autoload.pth is not at the root of the installed distribution (setup.py build_py)"
    )


INSTALLED = ("timm_lambda", "timm_lambda_mmdet", "mmdet_plugin")  # the packages users import (tests/test_layout.py)


def test_wheel_holds_what_users_import(tmp_path):
    """A wheel built from this tree holds every module of the installed packages, the CPU kernel's C++ sources and the
    autoload hook, and nothing else: not the tools' code (tools/_lib/) nor the lab (benchmarks/), no tests, no
    configs."""
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "data", "work_dirs", ".whl",
        ".gl"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "whl"),
         str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = {n for n in zipfile.ZipFile(next((tmp_path / "whl").glob("timm_lambda-*.whl"))).namelist()
             if ".dist-info/" not in n}
    modules = {p.relative_to(REPO).as_posix() for package in INSTALLED for pattern in ("*.py", "*.cpp", "*.h")
               for p in (REPO / package).rglob(pattern)}
    assert {f"timm_lambda/layers/position_lambda/tiled_cpu{name}" for name in (".cpp", "_bf16.cpp", ".h")} <= modules
    assert modules and modules <= names, sorted(modules - names)
    hook = {"timm_lambda_autoload.py", "timm_lambda_autoload.pth"}
    assert names == modules | hook, f"extra: {sorted(names - modules - hook)}, missing: {sorted(hook - names)}"


def _write_stub(root, timm_lambda_body):
    """A fake `timm` + `timm_lambda` pair, found before the real ones via PYTHONPATH."""
    (root / "timm").mkdir()
    (root / "timm" / "__init__.py").write_text(textwrap.dedent(
        """
        import sys
        EVENTS = ["timm start, plugin loaded=%s" % ("timm_lambda" in sys.modules)]
        _models = []
        def list_models():
            return list(_models)
        FINISHED = True
        """
    ))
    (root / "timm_lambda").mkdir()
    (root / "timm_lambda" / "__init__.py").write_text(textwrap.dedent(timm_lambda_body))


def test_hook_imports_plugin_after_timm_finished(tmp_path):
    stub = tmp_path / "stub"
    stub.mkdir()
    _write_stub(stub, """
        import timm  # re-entrant import of the module being loaded must work
        assert getattr(timm, "FINISHED", False), "plugin ran before timm/__init__ finished"
        timm.EVENTS.append("plugin")
        timm._models.append("lambdaresnet101")
        """)
    proc = run_py(
        f"""
        import sys
        import timm_lambda_autoload
        assert "timm_lambda" not in sys.modules
        import timm
        assert timm.__file__.startswith({str(stub)!r}), timm.__file__
        print(timm.EVENTS, timm.list_models())
        """,
        tmp_path,
        env_extra={"PYTHONPATH": str(stub)},
    )
    assert proc.stdout.strip() == "['timm start, plugin loaded=False', 'plugin'] ['lambdaresnet101']"
    assert proc.stderr == "", proc.stderr


def test_hook_failure_warns_and_keeps_timm(tmp_path):
    stub = tmp_path / "stub"
    stub.mkdir()
    _write_stub(stub, "raise RuntimeError('plugin exploded')\n")
    code = """
        import timm_lambda_autoload, timm
        print(timm.FINISHED, timm.list_models())
        """
    proc = run_py(code, tmp_path, env_extra={"PYTHONPATH": str(stub)})
    assert proc.stdout.strip() == "True []"
    assert "RuntimeWarning" in proc.stderr and "plugin exploded" in proc.stderr, proc.stderr
    # even with warnings turned into errors, `import timm` must not break
    proc = run_py(code, tmp_path, env_extra={"PYTHONPATH": str(stub)}, args=("-W", "error"))
    assert proc.stdout.strip() == "True []"
    assert "plugin exploded" in proc.stderr, proc.stderr


def test_hook_can_be_disabled(tmp_path):
    stub = tmp_path / "stub"
    stub.mkdir()
    _write_stub(stub, "raise AssertionError('must not be imported')\n")
    proc = run_py(
        "import sys, timm; print('timm_lambda' in sys.modules)",
        tmp_path,
        env_extra={"PYTHONPATH": str(stub), "TIMM_LAMBDA_NO_AUTOLOAD": "1"},
    )
    assert proc.stdout.strip() == "False"


# --------------------------------------------------------------------------
# both packages import; the timm part works without the OpenMMLab stack
# --------------------------------------------------------------------------
BLOCK_OPENMMLAB = """
import sys

class _BlockOpenMMLab:
    blocked = ("mmdet", "mmengine", "mmcv")
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.blocked:
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked by test)", name=fullname)
        return None

sys.meta_path.insert(0, _BlockOpenMMLab())
"""


def test_timm_part_imports_without_openmmlab(tmp_path):
    proc = run_py(
        BLOCK_OPENMMLAB + textwrap.dedent("""
        import timm, timm_lambda
        assert "lambdaresnet101" in timm.list_models()
        assert not any(m.split(".")[0] in ("mmdet", "mmengine", "mmcv") for m in sys.modules)
        print("ok")
        """),
        tmp_path,
    )
    assert proc.stdout.strip() == "ok"


@pytest.mark.parametrize("package", ["timm_lambda_mmdet", "mmdet_plugin"])
def test_mmdet_plugin_without_mmdet_names_the_det_extra(tmp_path, package):
    proc = run_py(
        BLOCK_OPENMMLAB + textwrap.dedent(f"""
        try:
            import {package}
        except ImportError as e:
            print("IMPORT-ERROR:", e)
        else:
            print("imported")
        """),
        tmp_path,
    )
    out = proc.stdout.strip()
    assert out.startswith("IMPORT-ERROR:"), f"import {package} must fail without mmdet: {out!r}"
    assert INSTALL_HINT in out, f"the ImportError must tell the user to run {INSTALL_HINT}: {out!r}"


@requires_det
def test_both_packages_import(tmp_path):
    proc = run_py(
        """
        import warnings
        import timm_lambda, timm_lambda_mmdet
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import mmdet_plugin  # the old name keeps working, with a DeprecationWarning
        print(timm_lambda.__name__, timm_lambda_mmdet.__name__, mmdet_plugin.TimmLambdaResNet.__module__,
              any(issubclass(w.category, DeprecationWarning) for w in caught))
        """,
        tmp_path,
    )
    assert proc.stdout.split() == ["timm_lambda", "timm_lambda_mmdet", "timm_lambda_mmdet.backbone", "True"]


# --------------------------------------------------------------------------
# [det]: mmcv with compiled ops, mmdet's version checks
# --------------------------------------------------------------------------
@requires_det
def test_mmcv_compiled_ops_run_on_cpu(tmp_path):
    proc = run_py(
        """
        import torch, torchvision
        from mmcv.ops import RoIAlign, batched_nms

        boxes = torch.tensor([[0., 0., 10., 10.], [1., 1., 10., 10.],
                              [0., 0., 10., 10.], [20., 20., 30., 30.]])
        scores = torch.tensor([0.9, 0.8, 0.7, 0.6])
        idxs = torch.tensor([0, 0, 1, 0])          # box 2 is another class
        dets, keep = batched_nms(boxes, scores, idxs, dict(type="nms", iou_threshold=0.5))
        assert keep.tolist() == [0, 2, 3], keep
        assert torch.allclose(dets[:, 4], torch.tensor([0.9, 0.7, 0.6])), dets

        # linear ramp f(y, x) = x + 6y: bilinear RoIAlign averages equal the bin centres
        feat = torch.stack([torch.arange(36.).reshape(6, 6), torch.ones(6, 6)])[None]
        rois = torch.tensor([[0., 0.5, 0.5, 4.5, 4.5], [0., 1., 0., 5., 3.]])
        out = RoIAlign((2, 2), spatial_scale=1.0, sampling_ratio=2, aligned=True)(feat, rois)
        assert out.shape == (2, 2, 2, 2), out.shape
        assert torch.allclose(out[0, 0], torch.tensor([[7., 9.], [19., 21.]])), out[0, 0]
        assert torch.allclose(out[:, 1], torch.ones(2, 2, 2)), out[:, 1]
        ref = torchvision.ops.roi_align(feat, rois, (2, 2), 1.0, 2, aligned=True)
        assert torch.allclose(out, ref, atol=1e-5), (out, ref)
        print("ok")
        """,
        tmp_path,
    )
    assert proc.stdout.strip() == "ok"


@requires_det
def test_mmdet_version_checks_pass(tmp_path):
    # mmdet/__init__.py asserts compatible mmcv and mmengine versions on import
    proc = run_py(
        "import mmdet, mmcv, mmengine; print(mmdet.__version__, mmcv.__version__, mmengine.__version__)",
        tmp_path,
    )
    assert len(proc.stdout.split()) == 3


# --------------------------------------------------------------------------
# constraints.txt pins exactly what is installed
# --------------------------------------------------------------------------
def _pins():
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;]+)", line)
        assert m, f"constraints.txt: not an exact `name==version` pin: {line!r}"
        pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


def test_constraints_pin_the_installed_versions():
    from packaging.version import Version  # packaging is a pytest dependency

    pins = _pins()
    must = list(CORE_DISTS) + (list(DET_DISTS) if (HAVE_DET or REQUIRE_DET) else [])
    missing = [d for d in must if d not in pins]
    assert not missing, f"constraints.txt does not pin {missing}"
    mismatched = []
    for dist, pinned in sorted(pins.items()):
        if dist in BUILD_TOOLS:
            continue
        try:
            have = md.version(dist)
        except md.PackageNotFoundError:
            if dist in must:
                mismatched.append(f"{dist}: pinned {pinned}, not installed")
            continue
        # ==2.14.1 also matches a local build such as 2.14.1+cu130 (PEP 440)
        want = Version(pinned)
        ok = Version(have) == want if want.local else Version(have).public == want.public
        if not ok:
            mismatched.append(f"{dist}: pinned {pinned}, installed {have}")
    assert not mismatched, "constraints.txt and the environment disagree:\n" + "\n".join(mismatched)


@requires_det
def test_setuptools_still_has_pkg_resources():
    # mmcv's setup.py and mmengine.utils.package_utils import pkg_resources (gone in setuptools 81)
    from packaging.version import Version

    assert Version(md.version("setuptools")) < Version("81"), md.version("setuptools")
