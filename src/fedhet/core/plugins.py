"""Objects named by an import path, ``MODULE:NAME``, so a config can name the user's own code.

``algorithm.name: mylab.methods:FedFoo`` or ``model.arch: mylab.nets:tiny_cnn`` names a method
class or a model builder in any module Python can import here: a package installed in the
environment (``pip install -e .``), or a folder on ``PYTHONPATH``. Every process that builds the
run (the simulator, the parallel engine's workers, each Flower node) imports it the same way, so
the module must be importable on each machine that runs clients.
"""

from __future__ import annotations

import importlib
import inspect
import os
import traceback


def is_import_path(name: str) -> bool:
    """Whether a config value names an object by ``MODULE:NAME`` rather than a built-in name."""
    return ":" in name


def _its_own(name: str, value: object, module: object) -> bool:
    """Whether a module's global is its own, not an import: not a module (torch), a class or function
    of another package (pydantic's Field), a type alias (``dict[str, Tensor]``, mostly imported) or a
    ``from __future__`` feature. What it exports (``__all__``) and takes from its own package's
    modules (an ``__init__`` re-exporting its methods) is its own."""
    own = getattr(module, "__name__", "")
    if name in (getattr(module, "__all__", None) or ()):
        return True
    if inspect.ismodule(value) or type(value).__module__ in ("__future__", "typing", "types"):
        return False
    if inspect.isclass(value) or inspect.isroutine(value):
        where = getattr(value, "__module__", None) or ""
        return where == own or where.startswith(own + ".")
    return True


def load_object(spec: str) -> object:
    """The object ``spec`` (``package.module:Name``, ``Name`` may be dotted) names; ``ValueError``
    with what is wrong and how to fix it when it cannot be imported (the caller names the key and
    the value before it)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ValueError("not an import path: write MODULE:NAME, e.g. mylab.methods:FedFoo")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(
                f"no module {module_name!r} can be imported here (working directory {os.getcwd()}); "
                f"install the package that holds it (pip install -e PATH) or put its folder on PYTHONPATH"
            ) from None
        raise ValueError(f"importing {module_name!r} failed, a module it imports is missing: {e}") from None
    except Exception as e:       # the user's module raised while importing: say where
        if isinstance(e, SyntaxError):       # raised by the compiler: its own file and line, not a frame's
            where = f" at {e.filename}:{e.lineno}"
        else:
            frames = traceback.extract_tb(e.__traceback__)
            where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        raise ValueError(f"importing {module_name!r} raised {type(e).__name__}{where}: {e}") from e
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n, v in vars(module).items() if not n.startswith("_") and _its_own(n, v, module))
            raise ValueError(f"module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                             f"{attr!r}; it defines: {', '.join(names) or 'nothing public'}")
        obj = getattr(obj, part)
    return obj


def describe(obj: object) -> str:
    """A short phrase for an object of the wrong kind in an error message."""
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    if inspect.isroutine(obj):
        return f"the function {getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', obj)}"
    return f"a {type(obj).__name__} ({obj!r:.60})"
