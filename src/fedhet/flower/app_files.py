"""The Flower app directory ``flwr run`` bundles (``pyproject.toml`` only: the ServerApp and
ClientApp are imported from the installed fedhet package, which must therefore be installed on
every host, like torch) and the run-config file ``flwr run --run-config`` reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedhet.core.errors import ConfigError, FedhetError

APP_NAME = "fedhet-flower"

RUN_CONFIG_DEFAULTS: dict[str, Any] = {
    "fedhet-config": "", "run-dir": "", "data-root": "",
    "min-clients": 1, "phase-timeout": 600.0, "node-timeout": 120.0, "poll-interval": 0.2,
    "resume": False, "node-state-dir": "",
}


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))        # a JSON string is a valid TOML basic string


def write_app(app_dir: str | Path) -> Path:
    """Write the Flower app directory (``pyproject.toml`` only) that ``flwr run`` bundles; a
    ConfigError for a path that is a file, and for a pyproject.toml there that fedhet did not write
    (a project of one's own is never written over)."""
    app_dir = Path(app_dir)
    if app_dir.exists() and not app_dir.is_dir():
        raise ConfigError(f"--out {app_dir} is a file: name a folder for the Flower app (a new one, or one this "
                          "command wrote before)")
    existing = app_dir / "pyproject.toml"
    if existing.exists() and _project_name(existing) != APP_NAME:
        raise ConfigError(f"{existing} exists and is not fedhet's Flower app: choose another --out (the app is one "
                          "pyproject.toml, written into a folder of its own)")
    config = "\n".join(f"{k} = {toml_value(v)}" for k, v in RUN_CONFIG_DEFAULTS.items())
    text = f"""# The fedhet Flower app; its apps come from the installed fedhet package (docs/deployment.md).
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{APP_NAME}"
version = "0.1.0"
description = "Any fedhet algorithm as a Flower app"
license = "Apache-2.0"
dependencies = ["fedhet", "flwr>=1.41,<1.43"]

[tool.flwr.app]
publisher = "fedhet"

[tool.flwr.app.components]
serverapp = "fedhet.flower.server_app:app"
clientapp = "fedhet.flower.client_app:app"

# Run config: every key must exist here to be overridable with `flwr run --run-config`.
[tool.flwr.app.config]
{config}
"""
    try:
        app_dir.mkdir(parents=True, exist_ok=True)
        existing.write_text(text)
    except OSError as e:
        raise ConfigError(f"cannot write the Flower app {existing}: {e.strerror or e}; choose another --out") from None
    return app_dir


def _project_name(pyproject: Path) -> str | None:
    """``[project] name`` of a pyproject.toml, None where it is not a readable TOML file that has one."""
    import tomllib

    try:
        return tomllib.loads(pyproject.read_text()).get("project", {}).get("name")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, AttributeError):
        return None


def write_run_config(path: str | Path, config_text: str, run_dir: str | Path | None = None,
                     **settings: Any) -> Path:
    """A TOML file for ``flwr run --run-config FILE``: the fedhet config plus app settings
    (``min_clients=2`` is written as ``min-clients = 2``)."""
    values = {"fedhet-config": config_text}
    if run_dir:
        values["run-dir"] = str(Path(run_dir).resolve())
    for k, v in settings.items():
        key = k.replace("_", "-")
        if key not in RUN_CONFIG_DEFAULTS:
            raise FedhetError(f"unknown Flower app setting {k!r}; known: {', '.join(RUN_CONFIG_DEFAULTS)}")
        if v is not None:
            values[key] = v
    path = Path(path)
    path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in values.items()))
    return path
