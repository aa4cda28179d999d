"""The clients' state store (engine/client_store.py): in memory up to a budget, spilled to disk
beyond it, snapshots that name files instead of copying them, and runs that resume exactly."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import assert_identical, run_killed_in_round

from fedhet.engine.client_store import ClientStates, Spilled, state_size
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics


def state(value: float, n: int = 256) -> dict:
    """A client state of ``n`` float32 entries (n * 4 bytes) beside a plain value."""
    return {"control": {"w": torch.full((n,), value)}, "round": int(value)}


def raw(store: ClientStates, cid: int):
    return dict.__getitem__(store, cid)


def test_state_size_counts_every_tensor():
    assert state_size(state(1.0)) == (1024, 256)
    assert state_size({"a": [torch.zeros(2, 3), (torch.zeros(4, dtype=torch.float64),)], "b": 7}) == (24 + 32, 10)


def test_memory_mode_is_a_plain_dict_of_states(tmp_path):
    store = ClientStates()
    store[3] = s = state(1.0)
    assert store[3] is s and store.get(4) is None and list(store) == [3] and store.spilled() == 0
    assert not (tmp_path / "client_states").exists()


def test_auto_mode_spills_the_least_recently_written_beyond_the_budget(tmp_path):
    store = ClientStates(tmp_path / "s", "auto", memory_budget=2 * 1024)      # two states fit
    for cid in range(3):
        store[cid] = state(float(cid))
    assert isinstance(raw(store, 0), Spilled) and not isinstance(raw(store, 2), Spilled)
    assert store.memory_bytes() == 2 * 1024 and store.spilled() == 1
    assert_identical(store[0], state(0.0))                  # read back from its file
    assert store.counters == {"spilled": 1, "loaded": 1}
    store[1] = state(10.0)                                  # rewritten: now the most recent
    store[3] = state(3.0)                                   # evicts client 2, not client 1
    assert isinstance(raw(store, 2), Spilled) and not isinstance(raw(store, 1), Spilled)
    assert store.tensor_floats() == 4 * 256 and store.counters["loaded"] == 1    # counted without loading
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [raw(store, 0).file, raw(store, 2).file]
    assert store.pop(0)["round"] == 0 and 0 not in store
    assert [p.name for p in (tmp_path / "s").iterdir()] == [raw(store, 2).file]   # its file went with it


def test_disk_mode_spills_every_state(tmp_path):
    store = ClientStates(tmp_path / "s", "disk")
    store[5] = state(5.0)
    assert isinstance(raw(store, 5), Spilled) and store.memory_bytes() == 0
    assert_identical(store[5], state(5.0))
    assert_identical(dict(store.items()), {5: state(5.0)})
    assert_identical(copy.deepcopy(store), {5: state(5.0)})       # a copy is a plain dict of the states
    assert_identical(dict(store), {5: state(5.0)}) and assert_identical({**store}, {5: state(5.0)})
    assert store.popitem()[0] == 5 and len(store) == 0 and not list((tmp_path / "s").iterdir())
    store[6] = {"seen": 3, "mean_loss": 0.25}              # no tensor: written all the same
    assert isinstance(raw(store, 6), Spilled) and store[6] == {"seen": 3, "mean_loss": 0.25}


def test_a_state_that_would_not_load_back_is_refused_when_spilled(tmp_path):
    import numpy as np

    from fedhet.core.errors import ConfigError

    store = ClientStates(tmp_path / "s", "disk")
    with pytest.raises(ConfigError, match=r"client 4's state\['stats'\]\['n'\] is a numpy.int64"):
        store[4] = {"stats": {"n": np.int64(3)}, "w": torch.zeros(2)}
    # a numpy float is a Python float too, but does not load back; refused as the method returns it,
    # though the budget of auto would keep it in memory for now
    store = ClientStates(tmp_path / "a", "auto", memory_budget=10**9)
    with pytest.raises(ConfigError, match=r"client 2's state\['seen'\] is a numpy.float64"):
        store[2] = {"seen": np.float64(0.5)}


def test_a_snapshot_names_files_that_stay_valid_until_the_next_one(tmp_path):
    store = ClientStates(tmp_path / "s", "disk")
    store[1], store[2] = state(1.0), state(2.0)
    snap = store.snapshot()
    assert snap["memory"] == {} and set(snap["spilled"]) == {1, 2}
    assert len(json.dumps(snap)) < 400                      # names, not the states' content
    store.commit()                                          # the checkpoint is on disk
    store[1] = state(100.0)                                 # a new file; the snapshot's stays
    store[7] = state(7.0)
    assert len(list((tmp_path / "s").iterdir())) == 4
    store.restore(copy.deepcopy(snap))
    assert sorted(store) == [1, 2]
    assert_identical(store[1], state(1.0)) and assert_identical(store[2], state(2.0))
    assert len(list((tmp_path / "s").iterdir())) == 2       # files written after the snapshot are gone
    store.snapshot()
    store.commit()
    store[2] = state(20.0)
    store.snapshot()
    # not committed yet (a kill while the checkpoint is written): the previous checkpoint's file stays
    assert len(list((tmp_path / "s").iterdir())) == 3
    store.commit()                                          # now only the new one is named
    assert len(list((tmp_path / "s").iterdir())) == 2
    assert_identical(store[2], state(20.0))


def test_a_run_killed_while_its_checkpoint_is_saved_resumes_from_the_previous_one(tmp_path):
    store = ClientStates(tmp_path / "s", "disk")
    store[1] = state(1.0)
    saved = store.snapshot()
    store.commit()
    store[1] = state(2.0)
    store.snapshot()                       # the process dies before the checkpoint is on disk
    fresh = ClientStates(tmp_path / "s", "disk")
    fresh.restore(copy.deepcopy(saved))
    assert_identical(fresh[1], state(1.0))


def test_restore_refuses_a_snapshot_whose_files_are_gone(tmp_path):
    store = ClientStates(tmp_path / "s", "disk")
    store[1] = state(1.0)
    snap = store.snapshot()
    for p in (tmp_path / "s").iterdir():
        p.unlink()
    from fedhet.core.errors import CheckpointError

    with pytest.raises(CheckpointError, match="client 1's state file"):
        ClientStates(tmp_path / "s", "disk").restore(snap)


def test_a_plain_dict_of_states_restores_into_any_mode(tmp_path):
    store = ClientStates(tmp_path / "s", "auto", memory_budget=1024)
    store.restore({1: state(1.0), 2: state(2.0)})
    assert store.spilled() == 1
    assert_identical(dict(store.items()), {1: state(1.0), 2: state(2.0)})


def test_a_spilled_snapshot_restores_into_a_memory_store_and_back(tmp_path):
    """run.client_state_store may change on resume: memory loads the spilled states, and a store
    that spills again later writes new files after every existing one, never over one."""
    disk = ClientStates(tmp_path / "s", "disk")
    disk[1], disk[2] = state(1.0), state(2.0)
    snap = disk.snapshot()
    disk.commit()
    memory = ClientStates(tmp_path / "s", "memory")
    memory.restore(copy.deepcopy(snap))
    assert memory.spilled() == 0
    assert_identical(dict(memory.items()), {1: state(1.0), 2: state(2.0)})
    plain = memory.snapshot()                               # a plain dict of the states
    memory.commit()                                         # the files are no longer needed
    assert not list((tmp_path / "s").iterdir())
    again = ClientStates(tmp_path / "s", "disk")
    again.restore(plain)
    again[3] = state(3.0)
    assert_identical(dict(again.items()), {1: state(1.0), 2: state(2.0), 3: state(3.0)})
    assert len({raw(again, c).file for c in again}) == 3


def scaffold(small_config, store: str, rounds: int = 4) -> dict:
    cfg = copy.deepcopy(small_config)
    cfg["algorithm"] = {"name": "scaffold"}
    cfg["train"]["rounds"] = rounds
    cfg["run"]["client_state_store"] = store
    return cfg


@pytest.mark.parametrize("store", ["disk", "auto"])
def test_a_spilling_run_equals_an_in_memory_one_and_resumes_exactly(small_config, tmp_path, monkeypatch, store):
    memory = Experiment.create(load_config(raw=scaffold(small_config, "memory")), tmp_path / "memory")
    memory.run(progress=False)
    cfg = scaffold(small_config, store)
    if store == "auto":
        cfg["run"]["client_state_memory_mb"] = 5      # two SCAFFOLD states of cnn2 (2.2 MB each) fit, the others spill
    exp = Experiment.create(load_config(raw=copy.deepcopy(cfg)), tmp_path / "spilled")
    run_killed_in_round(exp, monkeypatch, 3)          # checkpoint after round 2
    held = exp.loop.client_states
    if store == "disk":
        assert held.spilled() == len(held) > 0
    else:
        assert 0 < held.spilled() < len(held)
    resumed = Experiment.resume(exp.run_dir)
    resumed.run(progress=False)
    stable = [{k: v for k, v in r.items() if k not in ("seconds", "time")} for r in read_metrics(memory.run_dir)]
    assert [{k: v for k, v in r.items() if k not in ("seconds", "time")} for r in read_metrics(resumed.run_dir)] \
        == stable
    assert_identical(resumed.loop.server_state, memory.loop.server_state)
    assert_identical(dict(resumed.loop.client_states.items()), dict(memory.loop.client_states.items()))
    # the checkpoint names the files; it holds none of the states
    ckpt = torch.load(resumed.run_dir / "checkpoint.pt", weights_only=False)
    saved = ckpt["sim"]["client_states"]
    assert set(saved["spilled"]) | set(saved["memory"]) == set(resumed.loop.client_states)
    assert (saved["memory"] == {}) == (store == "disk")
    # the summary says what the store held and did, and the time it took
    said = resumed.summary["client_states"]
    assert said["mode"] == store and said["states"] == len(resumed.loop.client_states)
    assert said["spilled_now"] == resumed.loop.client_states.spilled() > 0 and said["spilled"] > 0
    assert said["loaded"] > 0 and said["seconds"] > 0
    assert memory.summary["client_states"] == {"mode": "memory", "states": len(memory.loop.client_states),
                                               "spilled_now": 0, "spilled": 0, "loaded": 0,
                                               "seconds": memory.summary["client_states"]["seconds"]}


def test_evaluation_loads_a_clients_state_only_for_a_method_whose_client_model_reads_it(small_config, tmp_path):
    """SCAFFOLD evaluates every client with the global model: its c_i (on disk here) are not read
    back for the evaluation. FedAvg's local BatchNorm statistics are, and so is the state of any
    method with a client_model of its own (here SCAFFOLD's, unread)."""
    from helpers import bn_model, build_loop

    from fedhet.algorithms.scaffold import Scaffold
    from fedhet.metrics.evaluate import evaluate_loop

    class OwnView(Scaffold):
        name = "own_view"

        def client_model(self, cid, state, client_state):
            return super().client_model(cid, state, client_state)

    def loads_in_evaluation(algorithm_name, params=None, algorithm=None) -> int:
        raw = copy.deepcopy(small_config)
        raw["algorithm"] = {"name": algorithm_name, "params": params or {}}
        raw["train"].update(rounds=1, clients_per_round=6)
        loop = build_loop(load_config(raw=raw), algorithm=algorithm, models={"cnn2": bn_model()})   # BN buffers
        loop.client_states = ClientStates(tmp_path / algorithm_name / "states", "disk")
        loop.run_round(0)
        assert len(loop.client_states) == 6
        loads = []
        real_get = loop.client_states.get
        loop.client_states.get = lambda cid, default=None: loads.append(cid) or real_get(cid, default)
        assert evaluate_loop(loop)["personal_clients"] == 6
        return len(loads)

    assert loads_in_evaluation("scaffold") == 0
    assert loads_in_evaluation("fedavg", {"bn_buffers": "local"}) == 6
    assert loads_in_evaluation("scaffold", algorithm=OwnView()) == 6
