"""Communication and persistent client memory per method, against the FedFM paper's Table VI.

Table VI gives bandwidth in model-sized units relative to FedAvg: FedAvgM, FedProx,
FedDyn, FedNova and MOON communicate like FedAvg (1x), SCAFFOLD twice (its control variates
travel both ways). The memory a client keeps between rounds: SCAFFOLD its c_i, FedDyn its
gradient state, MOON its previous model (one model each); FedAvg-like methods nothing.
"""

import copy

import pytest

from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics

BANDWIDTH = {"fedavg": 1, "fedavgm": 1, "fedprox": 1, "feddyn": 1, "fednova": 1, "moon": 1, "fedrs": 1, "scaffold": 2}
STATE_MODELS = {"fedavg": 0, "fedavgm": 0, "fedprox": 0, "feddyn": 1, "fednova": 0, "moon": 1, "fedrs": 0, "scaffold": 1}
# The server's: the global model, and one more model-sized tensor set for FedAvgM's momentum, FedDyn's
# h and SCAFFOLD's global control variate.
SERVER_MODELS = {"fedavg": 1, "fedavgm": 2, "fedprox": 1, "feddyn": 2, "fednova": 1, "moon": 1, "fedrs": 1, "scaffold": 2}


@pytest.mark.parametrize("name", sorted(BANDWIDTH))
def test_bandwidth_and_client_memory_match_table_vi(name, small_config, tmp_path):
    """And the server's memory, model-sized units of it."""
    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": name}
    raw["train"].update(rounds=1, local_epochs=1)
    raw["eval"]["personalized"] = False
    exp = Experiment.create(load_config(raw=raw), tmp_path / name)
    exp.run(progress=False)
    row = read_metrics(exp.run_dir)[0]
    n_params = sum(v.numel() for v in exp.loop.server_state["model"].values())
    per_client = sum(v["floats"] for v in row["comm"].values()) / len(row["clients"])
    assert per_client == BANDWIDTH[name] * 2 * n_params        # down + up
    # parameters only (no BatchNorm buffers in cnn2), so one model of state = n_params floats
    assert row["client_state_floats"] == STATE_MODELS[name] * n_params * len(row["clients"])
    assert row["server_state_floats"] == SERVER_MODELS[name] * n_params
