"""Run any fedhet algorithm on Flower (``flwr``), unchanged: see docs/deployment.md.

* :mod:`fedhet.flower.server_app` - ``app``, a ServerApp whose ``@app.main()`` loop drives the
  algorithm's round generator through Flower's Grid and writes the usual run directory;
* :mod:`fedhet.flower.client_app` - ``app``, a ClientApp that rebuilds the client side from the
  run config, loads its own partition from local data and runs ``algorithm.client_update``,
  keeping client state in ``context.state``;
* :mod:`fedhet.flower.deploy` - ``fedhet flower run`` (a config run on a fresh loopback
  deployment, :func:`~fedhet.flower.deploy.run_loopback`) and ``fedhet flower app``;
* :mod:`fedhet.flower.loopback` - the one-machine deployment: a SuperLink and SuperNodes on
  127.0.0.1, each in its own process group, and the ``flwr`` commands that submit and follow a run;
* :mod:`fedhet.flower.app_files` - the app directory and run-config file ``flwr run`` needs;
* :mod:`fedhet.flower.credentials` - a TLS certificate authority and server certificate, and the
  key pairs of SuperNode authentication.

Flower is an optional dependency (``pip install -e .[flower]``); importing the apps without
it raises a :class:`fedhet.core.errors.FedhetError` that says so.
"""

from __future__ import annotations

from fedhet.core.errors import FedhetError

INSTALL_HINT = "pip install -e .[flower]   (or: pip install 'flwr==1.41.0')"


class FlowerMissingError(FedhetError):
    """flwr is not installed."""


def require_flower() -> None:
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise FlowerMissingError(f"fedhet's Flower support needs the flwr package: {INSTALL_HINT}") from None
