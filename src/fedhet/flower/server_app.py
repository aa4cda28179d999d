"""The fedhet ServerApp: ``@app.main()`` runs a whole fedhet experiment over Flower's Grid.

Run-config keys (``[tool.flwr.app.config]`` of the app, overridable with ``flwr run
--run-config``; :func:`fedhet.flower.app_files.write_app` writes them):

  fedhet-config   the fedhet YAML config (text); the clients build the same federation from it
  run-dir         where the server writes the run directory (default: run.out_dir/<name>-s<seed>-<time>)
  data-root       the dataset directory on the server host (default: data.root of the config)
  min-clients, phase-timeout, node-timeout, poll-interval   see :class:`fedhet.flower.engine.FlowerSettings`
  resume          true: continue the run in run-dir from its checkpoint (nodes reload their commits)
  node-state-dir  where nodes without a ``state-dir`` node-config key commit their clients' state

The server builds the federation too (for the global test set, the client sizes the round
context carries, and to check each node's fingerprint), then runs
:func:`fedhet.flower.engine.flower_experiment`: the simulator's loop with the clients behind
the Grid, writing the same run directory as ``fedhet run``.
"""

from __future__ import annotations

from fedhet.core.errors import ConfigError
from fedhet.flower import require_flower

require_flower()

from flwr.app import Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from fedhet.experiment.runner import Experiment  # noqa: E402
from fedhet.flower.client_app import CONFIG_KEY, parse_config  # noqa: E402
from fedhet.flower.engine import FlowerSettings, flower_experiment, log  # noqa: E402


def run_server(grid: Grid, run_config) -> Experiment:
    """Run the experiment described by ``run_config`` over ``grid``; returns it when done."""
    flower = FlowerSettings.from_run_config(run_config)
    text = run_config.get(CONFIG_KEY)
    if not text:
        raise ConfigError(f"the run config has no {CONFIG_KEY!r} (the fedhet YAML config)")
    cfg = parse_config(text, run_config.get("data-root") or None)
    given = run_config.get("resume", False)
    if str(given).lower() not in ("true", "1", "yes", "false", "0", "no", ""):
        raise ConfigError(f"run config resume={given!r}: expected true or false")
    resume = str(given).lower() in ("true", "1", "yes")
    exp = flower_experiment(cfg, run_config.get("run-dir") or None, grid, flower, resume=resume)
    if exp.start_round:
        log.info("fedhet: resuming after round %d", exp.start_round)
    if (note := exp.set_aside_note()) is not None:
        log.info("fedhet: %s", note)
    log.info("fedhet: %s (%s, %d rounds) -> run directory %s", cfg.name, cfg.algorithm.name, cfg.train.rounds,
             exp.run_dir.resolve())
    summary = exp.run(progress=False)
    log.info("fedhet: run finished: %s", {k: summary[k] for k in ("status", "rounds_completed", "headline")})
    return exp


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, context.run_config)
