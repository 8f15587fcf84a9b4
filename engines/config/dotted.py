"""A user's code named in the config: ``module:name`` or ``path/to/file.py:name`` (``reward.rule``,
``rollout.env``, ``rollout.tools``), imported by the engine hosts before any engine loads."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def load(spec: str, field: str, error: type[Exception] = ValueError, kind: str = "function"):
    """The ``kind`` of object ``spec`` names; a failure raises ``error`` naming ``field`` (the config field) and the cause."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise error(f"{field}: '{spec}' is neither 'module:{kind}' nor 'path/to/file.py:{kind}'")
    if where.endswith(".py") or "/" in where:
        module = _import_file(spec, Path(where), field, error)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise error(
                f"{field}: cannot import module '{where}' ({type(e).__name__}: {e}); the engine hosts import it, so it "
                f"must be on their PYTHONPATH (working directory {Path.cwd()}), or give the file: "
                f"{field}=path/to/{where.replace('.', '/')}.py:{name}"
            ) from e
    found = getattr(module, name, None)
    if found is None:
        raise error(f"{field}: {where} has no {kind} '{name}'")
    return found


def _import_file(spec: str, path: Path, field: str, error: type[Exception]):
    if not path.is_file():
        raise error(f"{field} {spec}: no file {path.resolve()}")
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # as `python file.py` would: the file may import its neighbours
    module_spec = importlib.util.spec_from_file_location(f"yattflow_user_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any failure of the user's file is reported by name
        raise error(f"{field} {spec}: importing {path} failed ({type(e).__name__}: {e})") from e
    return module
