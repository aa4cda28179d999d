"""``fedhet features RUN_DIR``: feature-space quality of a run's global model (FedFM paper
(Ye et al.) Table V: k-means NMI and silhouette; Fig. 6: t-SNE scatter coloured by class).

The model is the one in the run's checkpoint (written every ``run.checkpoint_every`` rounds and
after the last round, so the final model of a finished run). Results go to
``features_round<N>.json`` and ``features_round<N>.png`` in the run directory. The same two
numbers can be recorded during a run with ``eval.features_every: k``.
"""

from __future__ import annotations

from pathlib import Path

from fedhet.core.errors import CheckpointError, ConfigError
from fedhet.experiment.build import build
from fedhet.experiment.config import load_config
from fedhet.experiment.rundir import CHECKPOINT, CONFIG, RunDir
from fedhet.metrics.features import feature_quality, global_test_features, tsne_embedding


def features_report(run_dir: str | Path, samples: int = 2000, seed: int = 0, plot: bool = True,
                    round: int | None = None) -> dict:
    """Compute the metrics (and the t-SNE plot) for the checkpointed global model of ``run_dir``;
    ``round``, if given, must be the checkpoint's round (only the latest checkpoint is kept)."""
    rundir = RunDir(run_dir)
    if not (rundir.path / CONFIG).is_file():
        raise ConfigError(f"{run_dir} is not a fedhet run directory (no {CONFIG})")
    snap = rundir.load_checkpoint()
    if snap is None:
        raise CheckpointError(f"{rundir.path} has no {CHECKPOINT}: the global model is saved every "
                              "run.checkpoint_every rounds and after the last round; let the run reach one")
    try:
        state, rnd = snap["sim"]["server_state"], int(snap["round"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{rundir.path / CHECKPOINT} does not hold a fedhet run's state ({e})") from None
    if round is not None and round != rnd:
        raise CheckpointError(f"{rundir.path} keeps the global model of round {rnd} only (its latest checkpoint), "
                              f"not of round {round}; to follow the metrics over rounds, record them during the "
                              "run with eval.features_every")
    built = build(load_config(rundir.path / CONFIG))
    weights = built.algorithm.global_model(state)
    if weights is None:
        raise ConfigError(f"{built.algorithm.name} has no global model; feature-space metrics need one")
    model = built.models[built.client_arch[0]]
    feats, labels = global_test_features(model, weights, built.federation, samples, seed)
    report = {"run": str(rundir.path), "round": rnd, "algorithm": built.algorithm.name, "samples": len(labels),
              "sample_seed": seed, **feature_quality(feats, labels, built.federation.num_classes, seed),
              "rule": "k-means (k = classes, 10 inits) NMI against the classes; silhouette with the classes as "
                      "clusters; features = the model's body output on a seeded sample of the global test set"}
    stem = f"features_round{rnd}"
    rundir.write_json(f"{stem}.json", report)          # the numbers first: a plot that fails loses none
    if plot:
        from fedhet.experiment.plots import plot_features

        plot_features(tsne_embedding(feats, seed), labels, rundir.path / f"{stem}.png",
                      f"{built.cfg.name}, round {rnd}: t-SNE of test features "
                      f"(NMI {report['feature_nmi']:.3f}, silhouette {report['feature_silhouette']:.3f})")
        report["plot"] = str(rundir.path / f"{stem}.png")
        rundir.write_json(f"{stem}.json", report)
    return report
