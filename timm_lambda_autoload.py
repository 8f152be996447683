"""Register the timm-lambda models with timm whenever ``timm`` is imported.

The wheel installs ``timm_lambda_autoload.pth`` into site-packages; its single
line ``import timm_lambda_autoload`` runs this module at interpreter start-up.
Start-up cost must stay negligible, so this module imports nothing beyond
``sys``/``os`` (already loaded by ``site``) and never imports torch or timm
itself.  It only puts a tiny finder on ``sys.meta_path``.  When a program
imports the top-level module ``timm``, the finder lets the normal finders
locate it, wraps the loader, and after ``timm/__init__.py`` has finished
executing runs ``import timm_lambda``, whose model modules call timm's
``register_model``.  That way timm's own ``train.py``/``validate.py``/
``benchmark.py`` accept ``--model lambdaresnet101`` without any change.

Guarantees:

* a process that never imports ``timm`` never imports ``timm_lambda`` or torch;
* ``import timm`` is never broken by this hook: if ``import timm_lambda``
  fails, a ``RuntimeWarning`` is emitted and ``timm`` is returned as usual
  (for a torch or timm older than timm-lambda's floor, the warning says which
  one and the ``pip install -U`` that fixes it);
* re-entrancy is guarded (``timm_lambda`` importing ``timm`` is fine).

Set ``TIMM_LAMBDA_NO_AUTOLOAD=1`` (or true/yes/on, any case) to disable the
hook (then ``import timm_lambda`` explicitly to register the models);
0/false/no/off or unset keep it.  Any other value keeps the hook, and the
``import timm_lambda`` it runs raises the error naming the variable's values
(shown as the hook's warning).  The variable is read at ``import timm`` by
the package's own parser, ``timm_lambda/_env.py``, loaded by its file (the
package itself is not imported for it).
"""
import os
import sys

__all__ = ["install", "uninstall", "TimmImportHook"]

_TARGET = "timm"
_PLUGIN = "timm_lambda"
_DISABLE_ENV = "TIMM_LAMBDA_NO_AUTOLOAD"


def _disabled():
    """Whether ``TIMM_LAMBDA_NO_AUTOLOAD`` turns the hook off, read by ``timm_lambda/_env.py`` (loaded by its file,
    without importing the package). An invalid value, or a package without that file, keeps the hook: the
    ``import timm_lambda`` it runs then says what is wrong."""
    if not os.environ.get(_DISABLE_ENV, "").strip():
        return False  # (unset: no file read)
    try:
        import importlib.util

        spec = importlib.util.find_spec(_PLUGIN)
        path = os.path.join(os.path.dirname(spec.origin), "_env.py")
        env_spec = importlib.util.spec_from_file_location("_timm_lambda_env", path)
        env = importlib.util.module_from_spec(env_spec)
        env_spec.loader.exec_module(env)
        return env.env(_DISABLE_ENV)
    except Exception:
        return False


def _load_plugin():
    """Import the plugin package; warn instead of raising on failure."""
    if _PLUGIN in sys.modules or _disabled():
        return
    try:
        __import__(_PLUGIN)
    except Exception as exc:  # never let a plugin error break `import timm`
        try:
            import warnings

            if isinstance(exc, ValueError) and str(exc).startswith("TIMM_LAMBDA_"):  # timm_lambda._env
                message = (
                    f"timm-lambda: {exc}; the LambdaResNet models are not registered with timm"
                )
            elif type(exc).__name__ == "VersionTooOld":  # timm_lambda._compat: torch/timm below the floor
                message = (
                    f"timm-lambda: the LambdaResNet models are not registered with timm: {exc} "
                    f"(or set {_DISABLE_ENV}=1 to silence this hook)"
                )
            else:
                message = (
                    f"timm-lambda: `import {_PLUGIN}` failed after `import {_TARGET}` "
                    f"({type(exc).__name__}: {exc}); the LambdaResNet models are not "
                    f"registered with timm. Run `python -c 'import {_PLUGIN}'` to see "
                    f"the full traceback, or set {_DISABLE_ENV}=1 to silence this hook."
                )
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        except Exception:  # e.g. `-W error`: still keep `import timm` working
            try:
                sys.stderr.write(f"timm-lambda: `import {_PLUGIN}` failed: {exc!r}\n")
            except Exception:
                pass


class _PostExecLoader:
    """Delegating loader: the real loader executes ``timm``, then the plugin is imported."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        self._loader.exec_module(module)  # errors from timm itself propagate unchanged
        _load_plugin()

    def __getattr__(self, name):  # get_resource_reader, get_source, is_package, ...
        return getattr(self._loader, name)

    def __repr__(self):
        return f"<timm_lambda_autoload wrapper of {self._loader!r}>"


class TimmImportHook:
    """``sys.meta_path`` finder that only reacts to the top-level module ``timm``."""

    def __init__(self):
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET or self._busy:
            return None
        self._busy = True
        try:
            spec = None
            seen_self = False
            for finder in list(sys.meta_path):
                if finder is self:
                    seen_self = True
                    continue
                if not seen_self:  # finders before us already declined
                    continue
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # not found / namespace package / legacy loader: leave alone
        spec.loader = _PostExecLoader(spec.loader)
        return spec

    def invalidate_caches(self):
        pass


def install():
    """Put the hook on ``sys.meta_path`` (idempotent; ``TIMM_LAMBDA_NO_AUTOLOAD`` is read when ``timm`` is
    imported). Returns the active hook or None."""
    for finder in sys.meta_path:
        if isinstance(finder, TimmImportHook) or type(finder).__name__ == "TimmImportHook":
            return finder
    if _TARGET in sys.modules:  # timm already imported (unusual): register right away
        _load_plugin()
        return None
    hook = TimmImportHook()
    sys.meta_path.insert(0, hook)
    return hook


def uninstall():
    """Remove every TimmImportHook from ``sys.meta_path``."""
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "TimmImportHook"]


install()
