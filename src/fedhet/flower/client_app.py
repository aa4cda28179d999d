"""The fedhet ClientApp: one SuperNode hosts one fedhet client (or every ``num-partitions``-th).

Each message may run in a fresh ``flwr-clientapp`` process (Flower's deployment runtime starts
one per message), so the handler rebuilds everything it needs from the run
config: the validated fedhet config (run-config key ``fedhet-config``, YAML text) gives the
federation, which is deterministic from config + seed, so the node builds it from its *local*
copy of the dataset and uses only its own clients' indices; no data crosses the wire. The
node's ``--node-config`` supplies ``partition-id`` and ``num-partitions`` (and optionally
``data-root``, the dataset directory on that machine, and ``device``, the device its clients train
on, in place of the config's ``run.device``: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``). Node ``p``
of ``n`` hosts the fedhet clients ``cid`` with ``cid % n == p`` (with ``n`` = number of clients:
exactly client ``p``).

The fedhet client id travels in every message (ConfigRecord ``"fedhet"``), never Flower's node
id, which changes when a SuperNode restarts. Client state survives between messages only in
``context.state`` (a RecordDict kept by the SuperNode for the run), stored per client id as a
tree (:func:`fedhet.flower.codec.tree_to_records`).

Message types (Flower routes on them):
  ``query.identify``  which clients this node hosts, their training-set sizes, a fingerprint
                      of their indices and the fedhet/torch/flwr versions (the server refuses a
                      node whose data or versions differ from its own)
  ``train``, ``train.<kind>``  one phase of ``Algorithm.round`` for every client of this node the
                      server sampled: ``client_update`` on each client's message (a batch,
                      :func:`fedhet.flower.codec.encode_batch`); replies a batch, per-client
                      stats and the errors of clients whose update raised
  ``evaluate``        one per node: each listed client's evaluation model (``Algorithm.client_model``
                      on the server state sent with the message and the local client state) on its
                      local test split; replies ``correct``/``total`` per client
  ``query.commit``    at the server's checkpoint rounds: write this node's clients' state to the
                      node-local state directory (:func:`commit_states`); a resumed run's identify
                      message reads it back (:func:`restore_states`)
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path


def _process_started() -> float | None:
    """Wall-clock time this process started (Linux /proc; None elsewhere): with the time the
    imports below end, it splits a message's latency into process start-up and the rest."""
    try:
        stat = open("/proc/self/stat").read()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


PROCESS_STARTED = _process_started()
IMPORTS_STARTED = time.time()

import torch  # noqa: E402
import yaml  # noqa: E402

from fedhet.core.errors import CheckpointError, ConfigError  # noqa: E402
from fedhet.engine.host import ClientHost, Job, Tally  # noqa: E402
from fedhet.engine.ledger import tensor_floats  # noqa: E402
from fedhet.experiment.build import Built, build, configure_process  # noqa: E402
from fedhet.experiment.config import ExperimentConfig, RunConfig, load_config  # noqa: E402
from fedhet.experiment.yaml_io import parse_yaml, yaml_problem  # noqa: E402
from fedhet.flower import require_flower  # noqa: E402
from fedhet.metrics.evaluate import predict  # noqa: E402
from fedhet.training.local import trains_in_channels_last  # noqa: E402

require_flower()

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from fedhet.flower import codec  # noqa: E402

IMPORTED = time.time()
CONFIG_KEY = "fedhet-config"

# Per-process cache of the built federation/models/algorithm: in deployment each message is a
# new process and this never hits; in-process (tests, Flower's simulation runtime) it saves
# reloading the data for every message. One entry: one run at a time keeps memory flat.
_BUILT: dict[tuple, Built] = {}


def parse_config(config_text: str, data_root: str | None = None, device: str | None = None) -> ExperimentConfig:
    """The fedhet config of a Flower run, with this host's dataset directory and device (when
    given), and the in-process engine set to ``reference``: Flower carries the clients, so worker
    processes or vmap (``run.engine``) have nothing to do here (and a node trains its clients one
    after another)."""
    try:
        raw = parse_yaml(config_text)
    except yaml.YAMLError as e:
        raise ConfigError(f"run config {CONFIG_KEY!r} is not valid YAML ({yaml_problem(e).splitlines()[0]}); write it "
                          "with fedhet flower app, or fix the text by hand") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"run config {CONFIG_KEY!r} must hold a fedhet YAML config")
    if data_root:
        raw.setdefault("data", {})["root"] = str(data_root)
    if device:
        raw.setdefault("run", {})["device"] = str(device)
    if "engine" in RunConfig.model_fields:
        run = raw.setdefault("run", {})
        run["engine"] = "reference"
        run.pop("workers", None)
    return load_config(raw=raw)


def built_for(config_text: str, data_root: str | None, device: str | None = None) -> Built:
    key = (config_text, data_root, device)
    if key not in _BUILT:
        cfg = parse_config(config_text, data_root, device)
        _BUILT.clear()
        configure_process(cfg)        # run.threads, as in the simulator: the same float sums
        _BUILT[key] = build(cfg)      # pure: no files written
    return _BUILT[key]


class Node:
    """What one SuperNode needs to act for its clients: the federation built from local data,
    the models, the algorithm and training settings - the simulator's own objects, built by
    :func:`fedhet.experiment.build.build` - so client updates are bit-identical."""

    def __init__(self, host: ClientHost, partition_id: int, num_partitions: int):
        self.host = host
        self.algorithm = host.algorithm
        self.federation = host.federation
        k = host.federation.num_clients
        if not 1 <= num_partitions <= k:
            raise ConfigError(f"num-partitions {num_partitions} must be between 1 and the number of clients {k}")
        if not 0 <= partition_id < num_partitions:
            raise ConfigError(f"partition-id {partition_id} must be in [0, num-partitions={num_partitions})")
        self.partition_id, self.num_partitions = partition_id, num_partitions
        self.clients = [c for c in range(k) if c % num_partitions == partition_id]

    def fingerprint(self) -> str:
        """Digest of this node's clients' train and test indices (and of the public set): equal on
        server and node iff both built the same federation (same data, config, seed and fedhet
        partitioning)."""
        h = hashlib.sha256()
        fed = self.federation
        for c in self.clients:
            h.update(fed.train_idx[c].numpy().tobytes())
            h.update(fed.test_idx[c].numpy().tobytes())
            h.update(fed.pool.y[fed.train_idx[c]].numpy().tobytes())
        if fed.public is not None:
            h.update(fed.public.numpy().tobytes())
        return h.hexdigest()[:16]

    def check_hosts(self, cid: int) -> None:
        if cid not in self.clients:
            raise ValueError(f"client {cid} is not hosted by partition {self.partition_id} of {self.num_partitions}")


def node_of(context: Context) -> Node:
    cfg_text = context.run_config.get(CONFIG_KEY)
    if not cfg_text:
        raise ConfigError(f"the run config has no {CONFIG_KEY!r} (the fedhet YAML config); "
                          "start runs with `fedhet flower run` or the run-config file of `fedhet flower app`")
    nc = context.node_config
    if "partition-id" not in nc or "num-partitions" not in nc:
        raise ConfigError("this SuperNode has no partition: start it with "
                          "--node-config 'partition-id=I num-partitions=N'")
    device = nc.get("device")
    built = built_for(cfg_text, nc.get("data-root"), str(device) if device else None)
    return Node(built.host, int(nc["partition-id"]), int(nc["num-partitions"]))


def state_prefix(cid: int) -> str:
    return f"fedhet.client.{cid}"


def load_state(context: Context, cid: int):
    return codec.tree_from_records(context.state, state_prefix(cid))


def save_state(context: Context, cid: int, state) -> None:
    codec.drop_tree(context.state, state_prefix(cid))
    if state is not None:
        codec.tree_to_records(state, context.state, state_prefix(cid))


class FedhetClientApp(ClientApp):
    """A ClientApp that accepts every ``train.<kind>`` type: fedhet methods name their phases
    freely (``exchange``, ``continue``, ``anchors`` ...), and Flower only routes registered
    actions (flwr.clientapp.ClientApp.__call__), so unseen actions are registered on arrival."""

    def __init__(self):
        super().__init__()
        self._train_actions: set[str] = {"default"}
        self.train()(handle_train)
        self.evaluate()(handle_evaluate)
        self.query("identify")(handle_identify)
        self.query("commit")(handle_commit)

    def __call__(self, message: Message, context: Context) -> Message:
        mtype = message.metadata.message_type
        if mtype.startswith("train.") and mtype.count(".") == 1:
            action = mtype.split(".", 1)[1]
            if action.isidentifier() and action not in self._train_actions:
                self._train_actions.add(action)
                self.train(action)(handle_train)
        return super().__call__(message, context)


def software_versions() -> dict[str, str]:
    """The fedhet, torch and flwr versions of this process, and fedhet's git commit ("" when it
    is not installed from a checkout). The server refuses a node whose versions differ from its
    own (the commit only when both know theirs): another torch or fedhet may train differently,
    and the run would no longer be the one its config describes."""
    import flwr

    from fedhet import __version__
    from fedhet.experiment.summary import git_commit

    return {"fedhet": __version__, "fedhet-commit": git_commit() or "", "torch": torch.__version__,
            "flwr": flwr.__version__}


def handle_identify(msg: Message, context: Context) -> Message:
    """Who this node is; in a resumed run (``restore-round`` in the message) it first loads the
    committed state of its clients listed in ``restore-clients``."""
    node = node_of(context)
    head = msg.content["fedhet"]
    restored: list[int] = []
    if "restore-round" in head:
        wanted = [c for c in json.loads(str(head["restore-clients"])) if c in node.clients]
        restored = restore_states(context, node, str(head["run-key"]), int(head["restore-round"]), wanted)
    sizes = [len(node.federation.train_idx[c]) for c in node.clients]
    return Message(RecordDict({"identify": ConfigRecord({
        "partition-id": node.partition_id, "num-partitions": node.num_partitions,
        "clients": node.clients, "train-sizes": sizes, "fingerprint": node.fingerprint(),
        "versions": json.dumps(software_versions()), "restored": json.dumps(restored),
        "training": json.dumps(training_of(node.host))})}), reply_to=msg)


def training_of(host: ClientHost) -> dict[str, str]:
    """How a host's clients train: its device and what ``run.precision`` and ``run.memory_format``
    resolved to there (``auto`` resolves by each machine's hardware, so nodes may differ)."""
    return {"device": str(host.device), "precision": host.settings.precision,
            "memory_format": "channels_last" if trains_in_channels_last(host.settings) else "contiguous"}


# --- node-local state for resuming deployments ---------------------------------------------
STATE_DIR_KEY = "state-dir"            # node config: this node's state directory
RUN_STATE_DIR_KEY = "node-state-dir"   # run config: the default for nodes without one


def state_dir(context: Context) -> Path:
    """Where this node commits its clients' state: node config ``state-dir``, else the run
    config's ``node-state-dir``, else ``$FLWR_HOME/fedhet-state`` (``~/.flwr/fedhet-state``)."""
    chosen = context.node_config.get(STATE_DIR_KEY) or context.run_config.get(RUN_STATE_DIR_KEY)
    if chosen:
        return Path(str(chosen)).expanduser()
    return Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr") / "fedhet-state"


def commit_path(root: Path, run_key: str, node: Node, rnd: int) -> Path:
    """One file per node and committed round, under the fedhet run's key (not Flower's run id,
    which a resumed run does not share)."""
    return root / run_key / f"partition-{node.partition_id}-of-{node.num_partitions}" / f"round-{rnd}.pt"


def commit_states(context: Context, node: Node, run_key: str, rnd: int, keep: int | None) -> list[int]:
    """Write the state of every client of this node after round ``rnd`` atomically (a reader
    never sees half a file), then delete older commits except round ``keep``: the server's last
    checkpoint, still needed if the server dies before its checkpoint of ``rnd`` is written."""
    path = commit_path(state_dir(context), run_key, node, rnd)
    states = {cid: load_state(context, cid) for cid in node.clients}
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"round": rnd, "run_key": run_key, "fingerprint": node.fingerprint(), "states": states}, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:           # its folder is not one (a file in the way): nothing was written
            pass
        raise CheckpointError(f"cannot write the node state {path}: {getattr(e, 'strerror', None) or e}; give the "
                              f"SuperNode a writable --node-config \"{STATE_DIR_KEY}='DIR'\"") from None
    for old in path.parent.glob("round-*.pt"):
        if old != path and old.name != f"round-{keep}.pt":
            old.unlink(missing_ok=True)
    return node.clients


def restore_states(context: Context, node: Node, run_key: str, rnd: int, cids: list[int]) -> list[int]:
    """Load the state ``cids`` had when round ``rnd`` was committed into ``context.state``."""
    if not cids:
        return []
    path = commit_path(state_dir(context), run_key, node, rnd)
    try:
        saved = torch.load(path, weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"this SuperNode has no committed state of round {rnd} for clients {cids} ({path} is "
                              f"missing): start it with the state directory it used before (--node-config "
                              f"\"{STATE_DIR_KEY}='DIR'\"), or start the run anew") from None
    except Exception as e:  # a truncated or foreign file
        raise CheckpointError(f"cannot read the node state {path}: {e}") from None
    if saved.get("run_key") != run_key or saved.get("fingerprint") != node.fingerprint():
        raise CheckpointError(f"{path} holds the state of another run or federation")
    for cid in cids:
        save_state(context, cid, saved["states"].get(cid))
    return cids


def handle_commit(msg: Message, context: Context) -> Message:
    node = node_of(context)
    head = msg.content["fedhet"]
    keep = int(head["keep-round"]) if "keep-round" in head else None
    clients = commit_states(context, node, str(head["run-key"]), int(head["round"]), keep)
    return Message(RecordDict({"commit": ConfigRecord({"clients": json.dumps(clients)})}), reply_to=msg)


def handle_train(msg: Message, context: Context) -> Message:
    """One phase for every client of this node the server sampled (one message per node, so one
    task at a time updates the node's ``context.state``). Each client's ``client_update`` runs in
    turn; one that raises is reported under ``errors`` with its state left as it was, and the
    others' replies still go back."""
    started = time.time()
    node = node_of(context)
    built = time.time()
    jobs, rnd = codec.decode_batch(msg.content)
    replies = {}
    stats: dict[str, list] = {k: [] for k in ("samples", "loss_sum", "steps", "state_floats", "seconds")}
    errors: dict[str, str] = {}
    for cid, fmsg in jobs.items():
        t0 = time.perf_counter()
        try:
            node.check_hosts(cid)
            result = node.host.run(rnd, Job(cid, fmsg, load_state(context, cid), Tally()))
        except Exception as e:  # reported to the server, which drops this client from the round
            errors[str(cid)] = f"{type(e).__name__}: {e}"
            continue
        save_state(context, cid, result.state)    # only after success: a failed update leaves the state as it was
        replies[cid] = result.reply
        # What SimClient.account counted in this phase; the server adds it to the client's round tally.
        tally = result.tally
        for key, value in (("samples", int(tally.samples)), ("loss_sum", float(tally.loss_sum or 0.0)),
                           ("steps", int(tally.steps)), ("state_floats", int(tensor_floats(result.state))),
                           ("seconds", time.perf_counter() - t0)):
            stats[key].append(value)
    content = codec.encode_batch(replies, rnd)
    content["stats"] = MetricRecord(stats)
    content["errors"] = ConfigRecord({"json": json.dumps(errors)})
    content["profile"] = MetricRecord(profile(started, built))
    return Message(content, reply_to=msg)


def profile(started: float, built: float) -> dict[str, float]:
    """Where this message's time went inside the node, in seconds. For the first message of a
    process: ``flwr`` from the process's start to this module's import (flwr-clientapp's start-up,
    pulling the message and the app), ``imports`` this module's imports (torch, fedhet), and
    ``setup`` from there to the handler; 0 for a process that served a message before (the
    in-process harness). Always: ``build`` the federation and models from the config, ``work``
    the clients' updates and the reply's encoding. Beside the server's phase time they show
    what a phase waits on."""
    global _served_before
    first, _served_before = not _served_before, True
    return {"flwr": round(IMPORTS_STARTED - PROCESS_STARTED, 3) if first and PROCESS_STARTED else 0.0,
            "imports": round(IMPORTED - IMPORTS_STARTED, 3) if first else 0.0,
            "setup": round(started - IMPORTED, 3) if first else 0.0,
            "build": round(built - started, 3), "work": round(time.time() - built, 3)}


_served_before = False      # this process answered a message already


@torch.no_grad()
def handle_evaluate(msg: Message, context: Context) -> Message:
    """Each listed client's evaluation model on its local test split: ``correct``/``total``/``loss``
    (summed cross-entropy) lists in the order of ``cids`` (what metrics/evaluate.py counts per client)."""
    started = time.time()
    node = node_of(context)
    built = time.time()
    head = codec.head_of(msg.content)
    cids = [int(c) for c in head["cids"]]
    views = codec.tree_from_records(msg.content, "server")
    host, fed = node.host, node.federation
    correct, total, loss = [], [], []
    for cid in cids:
        node.check_hosts(cid)
        state = load_state(context, cid) if node.algorithm.client_model_reads_state() else None
        weights = node.algorithm.client_model(cid, views[cid], state)
        arch = host.client_arch[cid]
        if weights is None:                # never trained: the common initialisation (RoundLoop.client_model)
            weights = host.init_models[arch]
        x, y = fed.local_test(cid)
        # on the node's device, as its clients train (host.models stay on the CPU for the server's use)
        hits, losses = predict(host.client_models[arch], weights, x, y, fed.normalize, int(head["batch-size"]),
                               str(head["precision"]) if "precision" in head else "fp32", host.device)
        correct.append(int(hits.sum()))
        total.append(int(len(y)))
        loss.append(float(losses.double().sum()))
    return Message(RecordDict({"eval": MetricRecord({"correct": correct, "total": total, "loss": loss}),
                              "profile": MetricRecord(profile(started, built))}), reply_to=msg)


app = FedhetClientApp()
