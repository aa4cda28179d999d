"""The Flower apps, in-process: the real ServerApp and ClientApp objects through a fake Grid.

No sockets and no Flower runtime: :class:`InProcGrid` hands every pushed message to the
ClientApp of its destination node at once, after a serialization round trip
of the content and of each node's ``context.state`` (what Flower's deployment runtime does
between processes), so encoding bugs show here too. A fresh ``Context`` object is made for
every message, like the new ``flwr-clientapp`` process of a deployment. The real transport is
covered by tests/flower/test_flower_deploy.py.

Equivalence: with every client answering, a run over Flower must leave the same server state
(bit for bit) and the same metrics as the reference simulator for the same config and seed.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr", reason="Flower is not installed (pip install -e .[flower])")

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.common.serde import (  # noqa: E402
    context_from_proto,
    context_to_proto,
    recorddict_from_proto,
    recorddict_to_proto,
)
from flwr.serverapp import Grid  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402
from helpers import assert_identical, deliver, small_config_in  # noqa: E402

from fedhet.core.errors import ConfigError, FedhetError  # noqa: E402
from fedhet.engine.loop import RoundStats  # noqa: E402
from fedhet.experiment.config import dump_config, load_config  # noqa: E402
from fedhet.experiment.runner import Experiment, read_metrics  # noqa: E402
from fedhet.flower import client_app as client_mod  # noqa: E402
from fedhet.flower import codec  # noqa: E402
from fedhet.flower.client_app import app as client_app  # noqa: E402
from fedhet.flower.engine import TooFewClientsError, load_server_state  # noqa: E402
from fedhet.flower.server_app import app as server_app  # noqa: E402

SERVER_NODE = 0
# Flower's runtime sets the identity of the running task; messages cannot be built without it.
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SERVER_NODE, 0


def _roundtrip(rd: RecordDict) -> RecordDict:
    return recorddict_from_proto(recorddict_to_proto(rd))


class InProcGrid(Grid):
    """A Grid whose nodes are ClientApp calls in this process (flwr's InMemoryGrid sets
    message ids through ``metadata.__dict__`` the same way).

    ``drop(message_type, partition_id, round) -> bool`` makes a node ignore a message (the
    server then waits out the phase timeout); ``fail`` the same but the node answers with an
    error, like a ClientApp that raised."""

    def __init__(self, n: int, run_config: dict, drop=None, fail=None):
        self.n, self.run_config = n, run_config
        self.drop, self.fail = drop or (lambda *a: False), fail or (lambda *a: False)
        self.node_ids = [1000 + 7 * i for i in range(n)]        # not the partition ids on purpose
        self.partition = {nid: i for i, nid in enumerate(self.node_ids)}
        self.states = {nid: context_to_proto(self._context(nid, RecordDict())) for nid in self.node_ids}
        self.replies: dict[str, Message] = {}
        self.log: list[tuple[str, int, int]] = []                # (message type, partition, group)
        self._run = None

    def _context(self, nid: int, state: RecordDict) -> Context:
        node_config = {"partition-id": self.partition[nid], "num-partitions": self.n}
        return Context(run_id=1, node_id=nid, node_config=node_config, state=state, run_config=self.run_config)

    def set_run(self, run):
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self):
        return list(self.node_ids)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = uuid.uuid4().hex
            m.metadata.__dict__["_message_id"] = mid
            ids.append(mid)
            nid, mtype = m.metadata.dst_node_id, m.metadata.message_type
            pid = self.partition[nid]
            rnd = m.metadata.group_id
            self.log.append((mtype, pid, rnd))
            if self.drop(mtype, pid, rnd):
                continue
            inbound = Message(_roundtrip(m.content), dst_node_id=nid, message_type=mtype, group_id=m.metadata.group_id)
            inbound.metadata.__dict__["_message_id"] = mid
            ctx = context_from_proto(self.states[nid])             # a fresh process sees only what was stored
            if self.fail(mtype, pid, rnd):
                reply = Message(Error(code=0, reason="<class 'RuntimeError'>:<'injected failure'>"), reply_to=inbound)
            else:
                try:
                    reply = client_app(inbound, ctx)
                    self.states[nid] = context_to_proto(ctx)
                except Exception as e:  # what flwr-clientapp turns an exception into
                    reply = Message(Error(code=0, reason=f"{type(e)}:<'{e}'>"), reply_to=inbound)
            if reply.has_content():
                reply = Message(_roundtrip(reply.content), reply_to=inbound)
            reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.replies[mid] = reply
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))


def flower_run(cfg, run_dir, n=None, drop=None, fail=None, **settings):
    """Run ``cfg`` through the real ServerApp/ClientApp over an InProcGrid; returns the grid."""
    rc = {"fedhet-config": dump_config(cfg), "run-dir": str(run_dir), "phase-timeout": 0.3, "node-timeout": 0.0,
          "poll-interval": 0.01, **{k.replace("_", "-"): v for k, v in settings.items()}}
    grid = InProcGrid(n or cfg.data.num_clients, rc, drop, fail)
    server_app(grid, Context(run_id=1, node_id=SERVER_NODE, node_config={}, state=RecordDict(), run_config=rc))
    return grid


def reference_run(cfg, run_dir):
    exp = Experiment.create(cfg, run_dir)
    exp.run(progress=False)
    return exp


def tiny(small_config, algorithm, **params):
    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": algorithm, "params": params}
    raw["train"].update(rounds=2, local_epochs=2)
    return load_config(raw=raw)


# Adding a method to the equivalence test is one line here.
EQUIVALENCE = [
    pytest.param("fedavg", {}, id="fedavg"),
    pytest.param("scaffold", {}, id="scaffold"),
    pytest.param("fedcme", {}, id="fedcme"),
    # round 0 is the warm-up (FedAvg), round 1 has the anchor phase and the training phase
    pytest.param("fedfm", {"start_round": 1, "lam": 1.0}, id="fedfm"),
    # one handshake; round 0 keeps the models on the clients, round 1 (the last) uploads them
    pytest.param("fedfm_lite", {"start_round": 1, "lam": 1.0, "model_every": 2}, id="fedfm_lite"),
    pytest.param("fedrema", {}, id="fedrema"),
    # scalar uploads (KL, score), mixup, per-epoch P; with the local models' risk evaluated on the server
    pytest.param("fedacd", {}, id="fedacd"),
    # the server keeps a copy of every client's model (a dict by client id) and mixes them
    pytest.param("ktpfl_weight", {"distill_lr": 2.5}, id="ktpfl_weight"),
]

# Row keys that measure time or the engine; everything else must match the simulator, exactly but
# for the losses of the personalized evaluation: the simulator reuses its global pass for clients
# tested with the global model and sums per-sample losses in another order than a node's own pass.
VOLATILE = {"seconds", "flower"}
SUMMED_DIFFERENTLY = {"personal_loss", "personal_loss_by_client"}


def assert_rows_match_simulator(sim_rows, fl_rows):
    """The Flower run's metric rows against the simulator's: the same keys, every value equal but
    the two personalized losses, which agree to rounding only (the resume test's tied on one
    intra-op thread on an Intel Xeon, and differed by 6e-9 relative on three threads in one CI run)."""
    assert len(fl_rows) == len(sim_rows)
    for s, f in zip(sim_rows, fl_rows):
        assert set(s) - VOLATILE == set(f) - VOLATILE, f["round"]
        for key in set(s) - VOLATILE - SUMMED_DIFFERENTLY:
            assert f[key] == s[key], (f["round"], key)
        assert f["personal_loss"] == pytest.approx(s["personal_loss"], rel=1e-5), f["round"]
        assert f["personal_loss_by_client"] == pytest.approx(s["personal_loss_by_client"], rel=1e-4, abs=2e-5), \
            f["round"]


@pytest.mark.parametrize("algorithm,params", EQUIVALENCE)
def test_flower_equals_simulator(small_config, tmp_path, algorithm, params):
    cfg = tiny(small_config, algorithm, **params)
    cfg.eval.local_risk = algorithm == "fedacd"
    ref = reference_run(cfg, tmp_path / "sim")
    flower_run(cfg, tmp_path / "flower")

    assert_identical(load_server_state(tmp_path / "flower")["server_state"], ref.loop.server_state)
    sim_rows, fl_rows = read_metrics(tmp_path / "sim"), read_metrics(tmp_path / "flower")
    assert len(fl_rows) == cfg.train.rounds
    assert_rows_match_simulator(sim_rows, fl_rows)
    for f in fl_rows:
        assert f["flower"]["phases"] and all(p["answered"] == p["sent"] for p in f["flower"]["phases"])
        assert "dropped" not in f["flower"]
    summary = json.loads((tmp_path / "flower" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["engine"]["engine"] == "flower"
    assert summary["flower"]["dropped_clients"] == 0 and summary["flower"]["drop_causes"] == {}
    assert summary["communication"] == ref.summary["communication"]
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "accuracy.png", "partition.json"):
        assert (tmp_path / "flower" / name).is_file(), name


def test_a_method_of_the_users_own_runs_on_flower_as_in_the_simulator(small_config, tmp_path, monkeypatch):
    """examples/extending's FedDamp, named by import path: the ServerApp and the ClientApps build it
    from the dumped config as the simulator does, and end with the same state and rows."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples" / "extending"))
    cfg = tiny(small_config, "feddamp:FedDamp", server_lr=0.5, logit_penalty=0.01)
    ref = reference_run(cfg, tmp_path / "sim")
    flower_run(cfg, tmp_path / "flower")
    assert_identical(load_server_state(tmp_path / "flower")["server_state"], ref.loop.server_state)
    assert_rows_match_simulator(read_metrics(tmp_path / "sim"), read_metrics(tmp_path / "flower"))
    assert json.loads((tmp_path / "flower" / "summary.json").read_text())["algorithm"] == "feddamp"


def test_fedcme_partner_dropped_continues_without_swap(small_config, tmp_path):
    """A client silent in phase A is dropped; its partner gets 'continue' in phase B and the
    round averages the two clients that finished (FedCME module docstring)."""
    cfg = tiny(small_config, "fedcme")
    cfg.train.rounds = 1
    ctx_clients = Experiment(cfg, tmp_path).loop.sample_clients(0)
    victim = ctx_clients[0]
    grid = flower_run(cfg, tmp_path / "run", drop=lambda mtype, pid, rnd: pid == victim and mtype == "train")
    (row,) = read_metrics(tmp_path / "run")
    assert set(row["flower"]["dropped"]) == {str(victim)}
    assert "no reply within" in row["flower"]["dropped"][str(victim)]
    phase_a, phase_b = row["flower"]["phases"]
    assert (phase_a["sent"], phase_a["answered"]) == (3, 2) and (phase_b["sent"], phase_b["answered"]) == (2, 2)
    (pair,) = [p for p in row["fedcme_pairs"] if victim in p]       # round 0 pairs in sampling order
    partner = pair[1] if pair[0] == victim else pair[0]
    assert partner is not None
    assert ("train.continue", partner, "1") in grid.log             # partition id = client id here
    assert not any(t == "train.exchange" and pid == partner for t, pid, _ in grid.log)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"


def test_too_few_clients_fails_with_cause_and_keeps_rows(small_config, tmp_path):
    cfg = tiny(small_config, "fedavg")
    cfg.train.rounds = 3
    cfg.run.checkpoint_every = 1
    with pytest.raises(TooFewClientsError, match=r"round 2, phase 1 \(train\): 1 of 3 clients answered, fewer than "
                                                 r"min-clients=2.*injected failure"):
        flower_run(cfg, tmp_path / "run", min_clients=2, fail=lambda mtype, pid, rnd: rnd == "2" and pid != 0
                   and mtype == "train")
    rows = read_metrics(tmp_path / "run")
    assert [r["round"] for r in rows] == [1]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "min-clients=2" in summary["error"]
    assert load_server_state(tmp_path / "run")["round"] == 1


def test_dropped_client_is_left_out_of_the_average(small_config, tmp_path):
    """FedAvg over the clients that answered: the same state as the simulator when that client
    is simply not in the replies."""
    cfg = tiny(small_config, "fedavg")
    cfg.train.rounds = 1
    exp = Experiment.create(cfg, tmp_path / "sim")
    victim = exp.loop.sample_clients(0)[1]
    # The simulator's own round generator, fed every reply but the victim's.
    gen = exp.algorithm.round(exp.loop.server_state, exp.loop.round_context(0, True))
    phase = gen.send(None)
    stats = RoundStats(0, list(phase))
    with pytest.raises(StopIteration) as stop:
        gen.send({c: deliver(exp.loop, c, m, 0, stats) for c, m in phase.items() if c != victim})
    expected = stop.value.value
    flower_run(cfg, tmp_path / "run", drop=lambda mtype, pid, rnd: pid == victim)
    assert_identical(load_server_state(tmp_path / "run")["server_state"], expected)
    (row,) = read_metrics(tmp_path / "run")
    assert str(victim) not in row["personal_acc_by_client"]       # its evaluate message was dropped too
    assert row["flower"]["evaluate"]["answered"] == cfg.data.num_clients - 1


def test_the_simulators_client_state_store_settings_are_said_to_be_ignored(small_config, tmp_path):
    cfg = tiny(small_config, "fedavg")
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"client_state_store": "disk"})})
    with pytest.warns(UserWarning, match="run.client_state_store and run.client_state_memory_mb are the "
                                         "simulator's: on Flower each node keeps its clients' states"):
        flower_run(cfg, tmp_path / "run")


def test_node_hosting_several_clients(small_config, tmp_path):
    """Two SuperNodes for six clients (node p hosts clients p, p+2, p+4): each node gets one
    message per phase with all its sampled clients, so its context.state keeps every client's
    state (SCAFFOLD's c_i), and the global model they share is sent once per node."""
    cfg = tiny(small_config, "scaffold")
    ref = reference_run(cfg, tmp_path / "sim")
    grid = flower_run(cfg, tmp_path / "run", n=2)
    assert_identical(load_server_state(tmp_path / "run")["server_state"], ref.loop.server_state)
    rows = read_metrics(tmp_path / "run")
    sim_rows = read_metrics(tmp_path / "sim")
    assert rows[-1]["client_state_floats"] == sim_rows[-1]["client_state_floats"]
    for row, sim_row in zip(rows, sim_rows):
        (phase,) = row["flower"]["phases"]
        nodes = {c % 2 for c in row["clients"]}
        assert phase["messages"] == len(nodes) and phase["sent"] == phase["answered"] == len(row["clients"])
        # every client gets the model and SCAFFOLD's control variate: once per node (plus Flower's
        # few bytes of shape and dtype per tensor), not once per client
        per_client = (sim_row["comm"]["down/model"]["bytes"] + sim_row["comm"]["down/control"]["bytes"]) // len(
            row["clients"])
        assert len(nodes) * per_client <= phase["down_bytes"] < 1.01 * len(nodes) * per_client
        # each client's reply is its own: what the ledger counts up, as sent
        up = sim_row["comm"]["up/model"]["bytes"] + sim_row["comm"]["up/control"]["bytes"]
        assert up <= phase["up_bytes"] < 1.01 * up
    rounds = {str(r + 1) for r in range(cfg.train.rounds)}
    train_log = [(pid, rnd) for mtype, pid, rnd in grid.log if mtype == "train"]
    assert len(train_log) == len(set(train_log)) and {rnd for _, rnd in train_log} == rounds
    # the nodes hold the states: the summary names no store of the server's
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["client_states"] is None


def test_each_nodes_training_settings_are_recorded_and_a_node_unlike_the_server_is_named(small_config, tmp_path,
                                                                                          monkeypatch, caplog):
    """run.precision and run.memory_format "auto" resolve on each node's hardware: every node's
    device, precision and layout land in summary.json (engine.nodes), and a node that trains
    otherwise than the server's summary records is named in a warning with both settings."""
    cfg = tiny(small_config, "fedavg")
    real = client_mod.training_of
    calls = []

    def second_node_in_bf16(host):       # the nodes identify in partition order, one call each
        calls.append(1)
        found = real(host)
        return {**found, "precision": "bf16", "memory_format": "channels_last"} if len(calls) == 2 else found

    monkeypatch.setattr(client_mod, "training_of", second_node_in_bf16)
    with caplog.at_level(logging.WARNING, logger="flwr.fedhet"):
        flower_run(cfg, tmp_path / "run", n=2)
    nodes = json.loads((tmp_path / "run" / "summary.json").read_text())["engine"]["nodes"]
    plain = {"device": "cpu", "precision": "fp32", "memory_format": "contiguous"}
    assert nodes == {"0": plain, "1": {**plain, "precision": "bf16", "memory_format": "channels_last"}}
    named = [r.getMessage() for r in caplog.records if "trains its clients with" in r.getMessage()]
    assert len(named) == 1 and "(partition 1)" in named[0]
    assert "precision bf16 (server: fp32), memory_format channels_last (server: contiguous)" in named[0]


def test_failing_client_on_a_shared_node_drops_only_that_client(small_config, tmp_path, monkeypatch):
    """A client whose update raises on a node that hosts others: it is dropped with the error,
    its state stays as it was, and the node's other clients' replies count (FedAvg over them)."""
    cfg = tiny(small_config, "fedavg")
    cfg.train.rounds = 1
    exp = Experiment.create(cfg, tmp_path / "sim")
    sampled = exp.loop.sample_clients(0)
    victim = next(c for c in sampled if any(o != c and o % 2 == c % 2 for o in sampled))
    host_run = client_mod.ClientHost.run

    def failing_run(self, rnd, job):
        if job.cid == victim:
            raise RuntimeError("injected client failure")
        return host_run(self, rnd, job)

    monkeypatch.setattr(client_mod.ClientHost, "run", failing_run)
    gen = exp.algorithm.round(exp.loop.server_state, exp.loop.round_context(0, True))
    phase = gen.send(None)
    stats = RoundStats(0, list(phase))
    with pytest.raises(StopIteration) as stop:
        gen.send({c: deliver(exp.loop, c, m, 0, stats) for c, m in phase.items() if c != victim})
    expected = stop.value.value
    flower_run(cfg, tmp_path / "run", n=2)
    assert_identical(load_server_state(tmp_path / "run")["server_state"], expected)
    (row,) = read_metrics(tmp_path / "run")
    assert set(row["flower"]["dropped"]) == {str(victim)}
    assert "RuntimeError: injected client failure" in row["flower"]["dropped"][str(victim)]
    assert row["flower"]["phases"][0]["answered"] == len(sampled) - 1
    # a run that ends "completed" with a client left out says so in its summary
    flower = json.loads((tmp_path / "run" / "summary.json").read_text())["flower"]
    assert flower["dropped_clients"] == 1
    assert flower["drop_causes"] == {"error on its node: RuntimeError": 1}


def test_drop_causes_count_one_failure_repeated_over_rounds_as_one_cause():
    from fedhet.flower.engine import drop_causes
    rows = [{"round": 1, "flower": {"dropped": {"3": "phase 1: error on its node: NumericalError: in round 1, client 3, "
                                                      "the loss is nan; lower train.lr",
                                                "4": "phase 1: no reply within 600 s"}}},
            {"round": 2, "flower": {"phases": []}},
            {"round": 3, "flower": {"dropped": {"5": "phase 2: error on its node: NumericalError: in round 3, client 5, "
                                                      "the loss is nan; lower train.lr"}}}]
    assert drop_causes(rows) == {"error on its node: NumericalError": 2, "no reply within 600 s": 1}


def test_node_with_other_data_is_refused(small_config, tmp_path):
    """A node whose federation differs (here: another seed in its config) is not used: its
    client is dropped as having no SuperNode, and the others train."""
    cfg = tiny(small_config, "fedavg")
    cfg.train.rounds = 1
    odd = Experiment(cfg, tmp_path).loop.sample_clients(0)[0]
    rc_other = dump_config(cfg.model_copy(update={"seed": cfg.seed + 1}))

    class Skewed(InProcGrid):
        def _context(self, nid, state):
            ctx = super()._context(nid, state)
            if self.partition[nid] == odd:
                ctx.run_config = {**ctx.run_config, "fedhet-config": rc_other}
            return ctx

    rc = {"fedhet-config": dump_config(cfg), "run-dir": str(tmp_path / "run"), "phase-timeout": 0.3,
          "node-timeout": 0.0, "poll-interval": 0.01}
    grid = Skewed(cfg.data.num_clients, rc)
    server_app(grid, Context(run_id=1, node_id=SERVER_NODE, node_config={}, state=RecordDict(), run_config=rc))
    (row,) = read_metrics(tmp_path / "run")
    assert [(t, pid) for t, pid, _ in grid.log if pid == odd] == [("query.identify", odd)]
    assert row["flower"]["dropped"] == {str(odd): "phase 1: no SuperNode hosts this client"}
    assert row["flower"]["phases"][0]["answered"] == 2


def test_node_with_other_versions_is_refused(small_config, tmp_path, monkeypatch):
    """The identify handshake carries fedhet/torch/flwr versions: nodes with another torch are
    refused and the run stops naming the difference; a node that cannot tell its fedhet commit
    (installed from a wheel) is still accepted when the versions agree."""
    cfg = tiny(small_config, "fedavg")
    cfg.train.rounds = 1
    real = client_mod.software_versions()
    monkeypatch.setattr(client_mod, "software_versions", lambda: {**real, "torch": "0.0.1"})
    with pytest.raises(FedhetError, match=rf"torch 0\.0\.1 \(server: {re.escape(torch.__version__)}\)"):
        flower_run(cfg, tmp_path / "other")
    assert read_metrics(tmp_path / "other") == []

    monkeypatch.setattr(client_mod, "software_versions", lambda: {**real, "fedhet-commit": ""})
    flower_run(cfg, tmp_path / "wheel")
    (row,) = read_metrics(tmp_path / "wheel")
    assert row["flower"]["phases"][0]["answered"] == cfg.train.clients_per_round and "dropped" not in row["flower"]


def test_codec_roundtrip():
    state = {"control": {"w": torch.randn(3, 2)}, "eval": {3: torch.ones(4), 7: None},
             "mid": {"scalars": {"partner": None, "share": True}, "steps": 5, "loss": 0.1 + 0.2,
                     "pairs": [[1, None], (2, 3)], "acc": None},
             "counts": torch.arange(5), "mask": torch.tensor([True, False]), "x": float("inf")}
    state["alias"] = state["control"]["w"]
    rd = RecordDict()
    codec.tree_to_records(state, rd, "s")
    back = codec.tree_from_records(_roundtrip(rd), "s")
    assert_identical(back, state)
    assert len(rd["s.tensors"]) == 4                                 # the aliased tensor travels once

    from fedhet.core.contract import Message as FedMessage
    msg = FedMessage("exchange", {"exchange": {"head.w": torch.randn(2, 2)}, "empty": {}},
                     {"partner": None, "num_samples": 12, "loss": 1.5, "tag": "x", "vec": [1, 2], "big": 2**70})
    shared = {"model.w": torch.randn(3, 3)}
    other = FedMessage("train", {"model": shared}, {"blob": b"\x00\xff", "lr": 0.01})
    third = FedMessage("train", {"model": shared}, {})
    rd = codec.encode_batch({5: msg, 2: other, 8: third}, 9)
    assert len(rd["batch.tensors"]) == 2                              # the shared model travels once
    out, rnd = codec.decode_batch(_roundtrip(rd))
    assert rnd == 9 and list(out) == [5, 2, 8] and out[5].kind == "exchange" and out[2].kind == "train"
    for cid, sent in ((5, msg), (2, other), (8, third)):
        assert_identical(out[cid].arrays, sent.arrays)
        assert_identical(out[cid].scalars, sent.scalars)
        assert list(out[cid].scalars) == list(sent.scalars)
    assert out[2].arrays["model"]["model.w"] is out[8].arrays["model"]["model.w"]
    assert codec.message_type("train") == "train" and codec.message_type("exchange") == "train.exchange"


def test_clear_errors(small_config, tmp_path):
    cfg = tiny(small_config, "fedavg")
    with pytest.raises(FedhetError, match="fedhet-config"):
        server_app(InProcGrid(2, {}), Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    with pytest.raises(FedhetError, match="min-clients=4 exceeds"):
        flower_run(cfg, tmp_path / "a", min_clients=4)
    # A node started without --node-config answers identify with an error and is not used.
    rc = {"fedhet-config": dump_config(cfg)}
    ctx = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config=rc)
    with pytest.raises(FedhetError, match="partition-id=I num-partitions=N"):
        client_mod.node_of(ctx)


def test_a_node_may_name_its_own_device(small_config):
    """``device`` in a SuperNode's --node-config replaces the config's run.device for that node's
    clients: a config naming a CUDA device this machine lacks is a clear error on a node without
    the key, and builds on a node that names its own device. (On a CUDA machine the config's device
    exists, so the first half is checked on CPU machines only.)"""
    cfg = tiny(small_config, "fedavg")
    cfg.run.device = "cuda:7"
    rc = {"fedhet-config": dump_config(cfg)}
    part = {"partition-id": 0, "num-partitions": 2}
    if torch.cuda.device_count() < 8:
        with pytest.raises(FedhetError, match="run.device: cuda:7"):
            client_mod.node_of(Context(run_id=1, node_id=5, node_config=part, state=RecordDict(), run_config=rc))
    node = client_mod.node_of(Context(run_id=1, node_id=5, node_config={**part, "device": "cpu"},
                                      state=RecordDict(), run_config=rc))
    assert node.host.device == torch.device("cpu") and node.clients == list(range(0, cfg.data.num_clients, 2))


# --- resume: server checkpoints, node commits ------------------------------------------------
class ServerCrash(Exception):
    """Stands for the SuperLink (and the ServerApp with it) going down."""


def resumable(small_config, rounds=4):
    cfg = tiny(small_config, "scaffold")       # c_i: client state that later rounds train with
    cfg.train.rounds = rounds
    cfg.run.checkpoint_every = 2
    return cfg


@pytest.fixture(scope="module")
def resumable_reference(synth_root, tmp_path_factory):
    """The uninterrupted simulator run both crash points are compared with: its metric rows and
    final server state, trained once for the module."""
    tmp = tmp_path_factory.mktemp("resumable-reference")
    exp = reference_run(resumable(small_config_in(synth_root, tmp / "runs")), tmp / "sim")
    return read_metrics(tmp / "sim"), exp.loop.server_state


@pytest.mark.parametrize("crash_at", ["round 4", "server checkpoint of round 4"])
def test_resumed_run_equals_uninterrupted(small_config, tmp_path, monkeypatch, crash_at, resumable_reference):
    """The server dies in round 4, or after the nodes committed round 4 but before its own
    checkpoint: the resumed run (fresh Flower run: empty context.state on every node) continues
    from the checkpoint of round 2, the nodes reload their clients' SCAFFOLD c_i from round 2,
    and the metrics and the final server state equal an uninterrupted run's."""
    cfg = resumable(small_config)
    sim_rows, ref_state = resumable_reference
    nodes = tmp_path / "node-state"
    if crash_at == "round 4":
        def crash(mtype, pid, rnd):
            if mtype == "train" and rnd == "4":
                raise ServerCrash
        run = lambda: flower_run(cfg, tmp_path / "flower", drop=crash, node_state_dir=str(nodes))  # noqa: E731
    else:
        from fedhet.experiment.rundir import RunDir

        real_save = RunDir.save_checkpoint

        def save(self, obj):
            if obj.get("round") == 4:
                raise ServerCrash
            real_save(self, obj)

        def run():
            with monkeypatch.context() as m:
                m.setattr(RunDir, "save_checkpoint", save)
                flower_run(cfg, tmp_path / "flower", node_state_dir=str(nodes))
    with pytest.raises(ServerCrash):
        run()
    assert load_server_state(tmp_path / "flower")["round"] == 2
    commits = sorted(p.name for p in nodes.rglob("round-*.pt"))
    assert commits == ["round-2.pt"] * 6 + (["round-4.pt"] * 6 if crash_at != "round 4" else [])

    flower_run(cfg, tmp_path / "flower", resume=True, node_state_dir=str(nodes))
    fl_rows = read_metrics(tmp_path / "flower")
    assert [r["round"] for r in fl_rows] == [1, 2, 3, 4]
    assert_rows_match_simulator(sim_rows, fl_rows)
    assert_identical(load_server_state(tmp_path / "flower")["server_state"], ref_state)
    assert json.loads((tmp_path / "flower" / "summary.json").read_text())["status"] == "completed"
    # the nodes keep the commit of the server's checkpoint before the last (round 2) and the last (4)
    assert sorted(p.name for p in nodes.rglob("round-*.pt")) == ["round-2.pt"] * 6 + ["round-4.pt"] * 6


def test_a_finished_run_extended_with_more_rounds_equals_an_uninterrupted_one(small_config, tmp_path,
                                                                            resumable_reference):
    """`fedhet flower run --resume RUN_DIR --set train.rounds=4` on a finished 2-round SCAFFOLD run:
    the nodes reload their clients' c_i of its last round, and the run ends with the metrics and
    server state of a 4-round run; config.yaml records the new rounds, so a later resume goes by them."""
    sim_rows, ref_state = resumable_reference
    nodes = str(tmp_path / "node-state")
    flower_run(resumable(small_config, rounds=2), tmp_path / "flower", node_state_dir=nodes)
    assert json.loads((tmp_path / "flower" / "summary.json").read_text())["status"] == "completed"
    flower_run(resumable(small_config), tmp_path / "flower", resume=True, node_state_dir=nodes)
    fl_rows = read_metrics(tmp_path / "flower")
    assert [r["round"] for r in fl_rows] == [1, 2, 3, 4]
    assert_rows_match_simulator(sim_rows, fl_rows)
    assert_identical(load_server_state(tmp_path / "flower")["server_state"], ref_state)
    assert load_config(tmp_path / "flower" / "config.yaml").train.rounds == 4
    # fewer rounds than recorded, or another value of what the run computes: refused, nothing lost
    other = resumable(small_config)
    other.algorithm.name = "fedavg"
    for cfg in (resumable(small_config, rounds=3), other):
        with pytest.raises(FedhetError, match=r"train.rounds 3 is below the 4 rounds .* has done: a resumed run can "
                                              r"be extended, not cut|differs from its config.yaml: algorithm.name"):
            flower_run(cfg, tmp_path / "flower", resume=True, node_state_dir=nodes)
    assert [r["round"] for r in read_metrics(tmp_path / "flower")] == [1, 2, 3, 4]


def test_resume_refuses_nodes_without_their_commits(small_config, tmp_path):
    """A node whose state directory lacks the commit its clients need is refused, naming the
    missing file; the run's rows up to the checkpoint are kept."""
    cfg = resumable(small_config)

    def crash(mtype, pid, rnd):
        if mtype == "train" and rnd == "3":
            raise ServerCrash

    with pytest.raises(ServerCrash):
        flower_run(cfg, tmp_path / "flower", drop=crash, node_state_dir=str(tmp_path / "node-state"))
    with pytest.raises(FedhetError, match=r"no committed state of round 2 .*round-2\.pt is missing"):
        flower_run(cfg, tmp_path / "flower", resume=True, node_state_dir=str(tmp_path / "elsewhere"))
    assert [r["round"] for r in read_metrics(tmp_path / "flower")] == [1, 2]


def test_flower_and_simulator_checkpoints_resume_only_on_their_own_engine(small_config, tmp_path):
    cfg = resumable(small_config, rounds=2)
    flower_run(cfg, tmp_path / "flower", node_state_dir=str(tmp_path / "node-state"))
    with pytest.raises(FedhetError, match=r"client states are with its clients \(a Flower deployment's SuperNodes\): "
                                          r"continue it with `fedhet flower run --resume"):
        Experiment.resume(tmp_path / "flower")
    reference_run(cfg, tmp_path / "sim")
    with pytest.raises(FedhetError, match=r"client states are in the file: continue it with `fedhet run --resume"):
        flower_run(cfg, tmp_path / "sim", resume=True)


def test_flower_run_resume_arguments_are_checked(small_config, tmp_path, capsys):
    from fedhet.cli import main as cli_main

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(dump_config(tiny(small_config, "fedavg")))
    (tmp_path / "empty").mkdir()
    cases = [(["flower", "run"], "give a CONFIG file, or --resume RUN_DIR"),
             (["flower", "run", "--resume", str(tmp_path / "none")], "none does not exist"),
             (["flower", "run", "--resume", str(tmp_path / "empty")], "is not a fedhet run directory"),
             (["flower", "run", str(cfg_path), "--resume", str(tmp_path)], "give no CONFIG (--set only for how"),
             (["flower", "run", "--resume", str(tmp_path), "--set", "train.lr=0.1"],
              "a resumed run takes --set only for how it is carried out"),
             (["flower", "run", str(cfg_path), "--min-clients", "0"], "--min-clients must be at least 1, got 0"),
             (["flower", "app", str(cfg_path), "--out", str(tmp_path / "app"), "--phase-timeout", "-1"],
              "--phase-timeout must be more than 0 seconds, got -1.0"),
             (["flower", "run", str(cfg_path), "--node-timeout", "nan"], "--node-timeout must be 0 or more seconds"),
             (["flower", "run", str(cfg_path), "--timeout", "0"], "--timeout must be more than 0 seconds, got 0.0"),
             (["flower", "run", str(cfg_path), "--timeout", "nan"], "--timeout must be more than 0 seconds"),
             (["flower", "run", str(cfg_path), "--auth", "--simulation"], "give one of the two"),
             (["flower", "app", str(cfg_path), "--out", ""], "--out is empty: name a folder"),
             (["flower", "app", str(cfg_path), "--out", str(tmp_path / "app"), "--run-dir", " "],
              "--run-dir is empty: name a folder")]
    for argv, message in cases:
        assert cli_main(argv) == 2
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "app").exists()                 # refused before the app is written


def test_flower_app_writes_the_app_and_run_config_and_never_a_project_of_ones_own(small_config, tmp_path, capsys):
    """`fedhet flower app CONFIG --out DIR`: DIR/pyproject.toml (fedhet's ServerApp and ClientApp) and
    DIR/run-config.toml holding the config; again into the same folder rewrites them; a folder holding
    a pyproject.toml of another project, or a file, is refused and left as it was."""
    import tomllib

    from fedhet.cli import main as cli_main

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(dump_config(tiny(small_config, "fedavg")))
    for _ in range(2):
        assert cli_main(["flower", "app", str(cfg_path), "--out", str(tmp_path / "app"), "--set", "train.rounds=7"]) == 0
    app = tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())
    assert app["tool"]["flwr"]["app"]["components"]["serverapp"] == "fedhet.flower.server_app:app"
    rc = tomllib.loads((tmp_path / "app" / "run-config.toml").read_text())
    assert load_config(raw=__import__("yaml").safe_load(rc["fedhet-config"])).train.rounds == 7
    capsys.readouterr()
    own = tmp_path / "project"
    own.mkdir()
    (own / "pyproject.toml").write_text('[project]\nname = "mine"\n')
    (tmp_path / "afile").write_text("x")
    for out, said in ((own, "is not fedhet's Flower app"), (tmp_path / "afile", "is a file")):
        assert cli_main(["flower", "app", str(cfg_path), "--out", str(out)]) == 2
        assert said in capsys.readouterr().err
    assert (own / "pyproject.toml").read_text() == '[project]\nname = "mine"\n' and sorted(own.iterdir()) == [
        own / "pyproject.toml"]


def test_flower_app_resume_writes_the_run_config_that_continues_the_run(small_config, tmp_path, capsys):
    """A real deployment resumes from a run config with its recorded config, its run-dir and
    resume = true (Flower takes no key=value beside a TOML file)."""
    import tomllib

    from fedhet.cli import main as cli_main

    cfg = tiny(small_config, "fedavg")
    flower_run(cfg, tmp_path / "run")
    assert cli_main(["flower", "app", "--resume", str(tmp_path / "run"), "--out", str(tmp_path / "app"),
                     "--set", "train.rounds=5"]) == 0
    assert "(resumes the run)" in capsys.readouterr().out
    rc = tomllib.loads((tmp_path / "app" / "run-config.toml").read_text())
    assert rc["resume"] is True and rc["run-dir"] == str((tmp_path / "run").resolve())
    given = load_config(raw=__import__("yaml").safe_load(rc["fedhet-config"]))
    assert given.train.rounds == 5 and given.model_copy(update={"train": cfg.train}) == load_config(
        tmp_path / "run" / "config.yaml")
    assert cli_main(["flower", "app", "--resume", str(tmp_path / "run"), "--out", str(tmp_path / "app"),
                     "--set", "train.lr=0.3"]) == 2                      # what it computes: refused
    assert "a resumed run takes --set only for how it is carried out" in capsys.readouterr().err
    # what the server would refuse only once deployed: fewer rounds than done, a simulator's checkpoint
    assert cli_main(["flower", "app", "--resume", str(tmp_path / "run"), "--out", str(tmp_path / "app"),
                     "--set", "train.rounds=1"]) == 2
    assert "train.rounds 1 is below the 2 rounds" in capsys.readouterr().err
    reference_run(cfg, tmp_path / "sim")
    assert cli_main(["flower", "run", "--resume", str(tmp_path / "sim")]) == 2
    assert "was written by a run whose client states are in the file: continue it with `fedhet run --resume" \
           in capsys.readouterr().err


def test_hand_edited_run_config_settings_are_checked(small_config):
    from fedhet.flower.engine import FlowerSettings

    assert FlowerSettings.from_run_config({"min-clients": 2, "poll-interval": "0.5"}).min_clients == 2
    for key, value, said in [("node-timeout", float("nan"), "expected a finite number"),
                             ("phase-timeout", "inf", "expected a finite number"),
                             ("min-clients", 2.9, "expected a whole number"), ("min-clients", True, "whole number"),
                             ("min-clients", float("inf"), "whole number"),
                             ("poll-interval", 200, r"poll-interval in \(0, 10\] seconds"),
                             ("phase-timeout", "ten", "expected a finite number")]:
        with pytest.raises(ConfigError, match=said):
            FlowerSettings.from_run_config({key: value})
    from fedhet.flower.client_app import parse_config
    with pytest.raises(ConfigError, match="run config 'fedhet-config' is not valid YAML"):
        parse_config("train: {rounds: [")


def test_flower_run_resume_hands_the_deployment_the_recorded_config_with_its_set_values(small_config, tmp_path,
                                                                                     monkeypatch):
    """--resume RUN_DIR --set train.rounds=N: the deployment gets config.yaml with the raised rounds
    (the server checks and records them: the test above)."""
    from fedhet.cli import main as cli_main
    from fedhet.flower import deploy

    cfg = tiny(small_config, "fedavg")
    flower_run(cfg, tmp_path / "run")
    handed = []

    def deployment(cfg, run_dir, **kwargs):
        handed.append((cfg, run_dir, kwargs["resume"]))
        raise KeyboardInterrupt

    monkeypatch.setattr(deploy, "run_loopback", deployment)
    monkeypatch.setattr(deploy, "flower_bin", lambda: None)
    assert cli_main(["flower", "run", "--resume", str(tmp_path / "run"), "--set", "train.rounds=5",
                     "--set", "run.device=cpu"]) == 130
    ((given, run_dir, resume),) = handed
    assert resume and run_dir == tmp_path / "run" and given.train.rounds == 5
    assert given.model_copy(update={"train": cfg.train}) == load_config(tmp_path / "run" / "config.yaml")


DEVICE = os.environ.get("FEDHET_TEST_DEVICE", "cpu")


@pytest.mark.skipif(DEVICE == "cpu", reason="needs FEDHET_TEST_DEVICE=cuda (a second device)")
def test_a_node_on_the_device_trains_and_evaluates_there(small_config, tmp_path, monkeypatch):
    """A run whose run.device is the device: every node trains and evaluates its clients there
    (no forward pass of a node's CPU models), and the metrics match the simulator's on the device."""
    raw = copy.deepcopy(small_config)
    raw["train"]["rounds"] = 1
    raw["run"]["device"] = DEVICE
    cfg = load_config(raw=raw)
    cpu_calls, evaluated_on = [], []
    real_build, real_predict = client_mod.build, client_mod.predict

    def build_with_hooks(cfg):
        built = real_build(cfg)
        for arch, model in built.host.models.items():
            model.register_forward_pre_hook(lambda *a, arch=arch: cpu_calls.append(arch))
        return built

    def spy(model, *args, **kwargs):
        device = args[6] if len(args) > 6 else kwargs.get("device", "cpu")       # where the passes run
        evaluated_on.append((next(model.parameters()).device.type, torch.device(device).type))
        return real_predict(model, *args, **kwargs)

    monkeypatch.setattr(client_mod, "build", build_with_hooks)
    monkeypatch.setattr(client_mod, "predict", spy)
    client_mod._BUILT.clear()
    ref = reference_run(cfg, tmp_path / "sim")
    flower_run(cfg, tmp_path / "flower")
    assert evaluated_on and set(evaluated_on) == {(torch.device(DEVICE).type, torch.device(DEVICE).type)}
    assert cpu_calls == [], f"{len(cpu_calls)} forward passes of a node's CPU models"
    sim_row, fl_row = read_metrics(tmp_path / "sim")[-1], read_metrics(tmp_path / "flower")[-1]
    assert fl_row["personal_acc_by_client"] == pytest.approx(sim_row["personal_acc_by_client"], abs=1e-6)
    assert ref.summary["device"] == DEVICE


def test_flower_evaluates_in_the_precision_eval_precision_names(small_config, tmp_path, monkeypatch):
    """eval.precision 'run' in a bf16 run: the server's global pass and every node's local-split
    passes run in bf16 (the message head carries it), and the metrics equal the simulator's."""
    raw = copy.deepcopy(small_config)
    raw["train"]["rounds"] = 1
    raw["run"]["precision"] = "bf16"
    raw["eval"]["precision"] = "run"
    cfg = load_config(raw=raw)
    asked = []
    real_predict = client_mod.predict

    def spy(*args, **kwargs):
        asked.append(args[6] if len(args) > 6 else kwargs.get("precision", "fp32"))
        return real_predict(*args, **kwargs)

    monkeypatch.setattr(client_mod, "predict", spy)
    ref = reference_run(cfg, tmp_path / "sim")
    flower_run(cfg, tmp_path / "flower")
    assert asked and set(asked) == {"bf16"}
    sim_row, fl_row = read_metrics(tmp_path / "sim")[-1], read_metrics(tmp_path / "flower")[-1]
    for key in ("global_loss", "global_acc", "personal_acc_by_client"):
        assert fl_row[key] == sim_row[key], key
    assert ref.summary["eval_precision"] == "bf16"
    assert json.loads((tmp_path / "flower" / "summary.json").read_text())["eval_precision"] == "bf16"


def test_flower_run_refuses_data_the_method_cannot_use_before_starting_flower(small_config, tmp_path, capsys,
                                                                             monkeypatch):
    """KT-pFL with a public set smaller than public_size: refused by the preflight, before any
    Flower process starts (run_loopback is never reached)."""
    from fedhet.cli import main as cli_main
    from fedhet.flower import deploy

    def started(*args, **kwargs):
        raise AssertionError("the loopback was started")

    monkeypatch.setattr(deploy, "run_loopback", started)
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": ["fca_cnn_a", "fca_cnn_b"]}
    raw["algorithm"] = {"name": "ktpfl", "params": {"public_size": 101, "distill_batch_size": 32}}
    raw["data"]["public"] = {"source": "holdout", "size": 100}
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(dump_config(load_config(raw=raw)))
    assert cli_main(["flower", "run", str(cfg_path), "--out", str(tmp_path / "run")]) != 0
    err = capsys.readouterr().err
    assert "public_size is 101 but the public set (data.public) has 100 images" in err and "Traceback" not in err


def test_flower_run_refuses_a_model_the_method_cannot_use_before_starting_flower(small_config, tmp_path, capsys,
                                                                                monkeypatch):
    """FedROD on a two-layer head: Algorithm.check_model in the preflight, before any Flower process starts."""
    from fedhet.cli import main as cli_main
    from fedhet.flower import deploy

    def started(*args, **kwargs):
        raise AssertionError("the loopback was started")

    monkeypatch.setattr(deploy, "run_loopback", started)
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": "cnn2", "split": "fc1"}
    raw["algorithm"] = {"name": "fedrod"}
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(dump_config(load_config(raw=raw)))
    assert cli_main(["flower", "run", str(cfg_path), "--out", str(tmp_path / "run")]) != 0
    err = capsys.readouterr().err
    assert "FedROD needs a linear classifier: model cnn2's head" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_node_state_dir_that_is_a_file_is_named_as_the_fix_says(tmp_path):
    from types import SimpleNamespace

    from fedhet.core.errors import CheckpointError
    from fedhet.flower.client_app import commit_states

    (tmp_path / "state").write_text("a file where the folder goes")
    context = SimpleNamespace(node_config={"state-dir": str(tmp_path / "state")}, run_config={}, state={})
    node = SimpleNamespace(clients=[], partition_id=0, num_partitions=1, fingerprint=lambda: "x")
    with pytest.raises(CheckpointError, match="cannot write the node state .*; give the SuperNode a writable"):
        commit_states(context, node, "run-key", 1, None)


def test_a_loopback_resume_takes_the_nodes_the_run_ran_on_and_says_an_old_error_is_not_its_own(
        small_config, tmp_path, monkeypatch):
    """Nodes commit by partition count: a resume on another count would find none of their commits.
    A resume that fails before writing a summary reports its own cause, not the summary of the
    run it resumes."""
    from fedhet.flower import deploy

    cfg = tiny(small_config, "fedavg")
    run_dir = tmp_path / "run"
    reference_run(cfg, run_dir)
    # a run from before the record: its nodes' commits say how many there were
    (run_dir / deploy.NODE_STATE / "run-key" / "partition-1-of-2").mkdir(parents=True)
    with pytest.raises(FedhetError, match=r"--nodes 3: .*committed their clients' state as 2 partitions"):
        deploy.run_loopback(cfg, run_dir, nodes=3, resume=True)
    (run_dir / deploy.LOOPBACK_NODES).write_text('{"nodes": 2}\n')
    with pytest.raises(FedhetError, match=r"--nodes 3: .*committed their clients' state as 2 partitions"):
        deploy.run_loopback(cfg, run_dir, nodes=3, resume=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "status": "interrupted",
                                                      "error": "interrupted by the user"}))
    started = []

    class Deployment:              # a deployment whose server fails before its summary
        def __init__(self, n, work, **kwargs):
            started.append(n)
            self.logs = work / "logs"
            self.logs.mkdir(parents=True, exist_ok=True)
            (self.logs / "run.log").write_text("fedhet.core.errors.CheckpointError: changed data\n")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, app, rc):
            return 1

        def follow(self, run_id, timeout, done_marker):
            return "finished:failed"

    monkeypatch.setattr(deploy, "Loopback", Deployment)
    with pytest.raises(deploy.DeploymentError) as info:
        deploy.run_loopback(cfg, run_dir, resume=True, workdir=tmp_path / "work")
    assert started == [2] and "CheckpointError: changed data" in str(info.value)
    assert "interrupted by the user" not in str(info.value)


def test_a_run_config_submitted_again_over_its_run_says_how_a_deployment_resumes(small_config, tmp_path):
    cfg = tiny(small_config, "fedavg")
    reference_run(cfg, tmp_path / "run")                      # a run in the run-dir the config names
    with pytest.raises(ConfigError, match=r"already holds a run: to continue it, submit the run config of "
                                          r"`fedhet flower app --resume .*run --out APP`"):
        flower_run(cfg, tmp_path / "run")


def test_certificates_for_no_host_or_a_too_long_common_name_are_refused(tmp_path):
    from fedhet.flower.credentials import make_certificates

    for hosts in ((), "localhost", ("x" * 65,)):
        with pytest.raises(ConfigError, match="hosts must be one or more IPs or DNS names"):
            make_certificates(tmp_path, hosts)
    assert make_certificates(tmp_path, ("localhost", "a" * 70 + ".example"))["cert"].is_file()
