"""The server side on Flower: the simulator's round loop with the clients behind a Grid.

:class:`GridTransport` is a transport of the one round loop (:class:`fedhet.engine.loop.RoundLoop`):
a phase's messages are not handed to ``client_update`` in-process but sent through Flower's
Grid, one Flower message per SuperNode carrying all its clients' messages (the tensors they
share, such as the global model, once), and the replies that come back within the phase timeout
are what the round generator receives. Sampling, round contexts, server state, aggregation and
the communication ledger are the loop's own code, so a run with every client answering equals
the simulator's (tests/flower/test_flower.py).

:func:`flower_experiment` is :class:`fedhet.experiment.runner.Experiment` with a GridTransport,
the nodes' evaluation, a server-state checkpointer and :class:`FlowerCallback`: the same run
directory (config.yaml, partition.json, metrics.jsonl, summary.json, accuracy.png).
Differences, all because client state lives on the nodes:

* personalized metrics come from the clients: each tests its own evaluation model on its local
  test split in an ``evaluate`` message and reports correct/total (a deployment's server never
  sees local test data); global metrics are computed on the server's global test set;
* checkpoints are two-sided, because Flower keeps ``context.state`` for one Flower run only:
  every ``run.checkpoint_every`` rounds the server asks each node to commit its clients' state
  to its node-local state directory (``query.commit``), then writes ``checkpoint.pt`` with its
  own state, the fedhet run's key and the clients whose nodes committed. A resumed run
  (run-config key ``resume``) continues from that round; its identify messages ask each node
  to load its clients' committed state first. Nodes keep the previous commit too, so a server
  that dies between the nodes' commit and its own still resumes from its last checkpoint.

Failure handling: a client whose node does not answer a phase within ``phase-timeout`` seconds,
answers with an error, or has no connected SuperNode is dropped from the round with a warning
(recorded in the metrics row under ``flower.dropped``); the round goes on if at least
``min-clients`` answered each phase, otherwise the run stops with :class:`TooFewClientsError`
and ``summary.json`` records status ``failed`` with that cause (the runner keeps every row
written so far).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from fedhet.core.contract import State
from fedhet.core.errors import ConfigError, FedhetError
from fedhet.engine import ClientHost, RoundLoop, Transport
from fedhet.engine.host import Job, JobResult, Tally
from fedhet.experiment.build import build
from fedhet.experiment.config import ExperimentConfig
from fedhet.experiment.rundir import CHECKPOINT, RunDir, read_metrics
from fedhet.experiment.runner import Callback, Experiment, RunView
from fedhet.flower import require_flower
from fedhet.metrics.evaluate import evaluate_loop, personal_metrics

require_flower()

from flwr.app import ConfigRecord, RecordDict  # noqa: E402
from flwr.app import Message as FlowerMessage  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402

from fedhet.flower import codec  # noqa: E402
from fedhet.flower.client_app import Node, software_versions, training_of  # noqa: E402

# Child of Flower's logger, so the lines appear in `flwr log` / `flwr run --stream`.
log = logging.getLogger("flwr").getChild("fedhet")

LEGACY_SERVER_STATE = "server_state.pt"     # what Flower runs wrote before they could be resumed


class TooFewClientsError(FedhetError):
    """Fewer than min-clients answered a phase."""


class FlowerRunError(FedhetError):
    """The Flower side of a run failed (no SuperNodes, inconsistent nodes)."""


@dataclass
class FlowerSettings:
    """Run-config keys of the fedhet Flower app (``[tool.flwr.app.config]``, docs/deployment.md)."""

    min_clients: int = 1          # a phase with fewer answers fails the run
    phase_timeout: float = 600.0  # seconds to wait for one phase's replies
    node_timeout: float = 120.0   # seconds to wait at the start for every client's SuperNode
    poll_interval: float = 0.2    # seconds between pulls (Flower's own send_and_receive sleeps 3 s)

    KEYS = {"min_clients": "min-clients", "phase_timeout": "phase-timeout", "node_timeout": "node-timeout",
            "poll_interval": "poll-interval"}

    @classmethod
    def from_run_config(cls, rc) -> FlowerSettings:
        """The settings a (possibly hand-edited) run config gives: whole numbers where counts go,
        finite numbers of seconds, each in its range; a ConfigError names the key otherwise."""
        s = cls()
        for attr, key in cls.KEYS.items():
            if key not in rc or rc[key] == "":
                continue
            value = rc[key]
            whole = attr == "min_clients"
            number = None
            if not isinstance(value, bool):
                try:
                    number = float(value)
                except (TypeError, ValueError):
                    pass
            if number is None or not math.isfinite(number) or (whole and not number.is_integer()):
                raise ConfigError(f"run config {key}={value!r}: expected a {'whole' if whole else 'finite'} number")
            setattr(s, attr, int(number) if whole else number)
        if s.min_clients < 1 or s.phase_timeout <= 0 or s.node_timeout < 0 or not 0 < s.poll_interval <= 10:
            raise ConfigError(f"run config: min-clients >= 1, phase-timeout > 0, node-timeout >= 0 and "
                              f"poll-interval in (0, 10] seconds are required; got {asdict(s)}")
        return s

    def run_config(self) -> dict[str, Any]:
        return {key: getattr(self, attr) for attr, key in self.KEYS.items()}


class GridTransport(Transport):
    """The round loop's clients behind a Flower Grid (see the module docstring)."""

    name = "flower"
    keeps_client_state = True      # in each node's context.state

    def __init__(self, grid: Grid, flower: FlowerSettings):
        self.grid = grid
        self.flower = flower
        self.node_of: dict[int, int] = {}       # fedhet client id -> Flower node id
        self.partition_of: dict[int, int] = {}  # node id -> partition id
        self.seen_nodes: set[int] = set()       # node ids asked to identify themselves
        self.versions = software_versions()     # a node must run the same ones
        self.standby: set[int] = set()          # answered, but their partition had a node already
        self.node_errors: list[str] = []        # why nodes could not act as fedhet nodes
        self.node_training: dict[int, dict[str, str]] = {}   # partition id -> how its node trains (training_of)
        self.num_partitions: int | None = None
        self.state_floats: dict[int, int] = {}  # latest client-state size reported by each client
        self.round_info: dict[str, Any] = {}          # this round's Flower record (metrics row "flower")
        self.run_key = uuid.uuid4().hex          # names the nodes' commits of this fedhet run
        self.checkpointed_round: int | None = None   # the round of the server's last checkpoint
        self.restore: dict[str, Any] | None = None   # resumed run: {"round", "clients" still to restore}
        self.last_round = -1
        self.phase_no = 0
        self.discovered = False

    def attach(self, host: ClientHost) -> None:
        super().attach(host)               # the server's copy: identifies nodes by their federation
        self.federation = host.federation

    def info(self) -> dict[str, Any]:
        return {"engine": "flower", "workers": len(self.partition_of),
                "reason": "clients on Flower SuperNodes (fedhet.flower)",
                "nodes": {str(pid): self.node_training[pid] for pid in sorted(self.node_training)}}

    # --- nodes --------------------------------------------------------------------------
    def discover(self) -> None:
        """Map fedhet clients to SuperNodes: ask every new node which partition it holds.

        The first call waits up to node-timeout seconds for a node per partition; later calls
        (each round) only identify nodes that appeared since (a restarted SuperNode has a new
        node id) and forget nodes Flower no longer lists."""
        t0 = time.monotonic()
        deadline = t0 + (0.0 if self.discovered else self.flower.node_timeout)
        k = self.federation.num_clients
        while True:
            listed = set(self.grid.get_node_ids())
            gone = [n for n in self.partition_of if n not in listed]
            for nid in gone:
                lost = [c for c, h in self.node_of.items() if h == nid]
                log.warning("fedhet: SuperNode %s (partition %s) is gone; clients %s have no node",
                            nid, self.partition_of.pop(nid), lost)
                for c in lost:
                    del self.node_of[c]
            new = sorted(listed - self.seen_nodes)
            if gone:
                # A restarted SuperNode (new node id) may have been turned away while its old id
                # was still listed: ask it again now that its partition is free.
                new += sorted(self.standby & listed)
                self.standby.clear()
            if new:
                self._identify(new)
            if len(self.node_of) == k or time.monotonic() >= deadline:
                break
            time.sleep(min(1.0, max(self.flower.poll_interval, 0.05)))
        if not self.discovered:
            self.discovered = True
            missing = [c for c in range(k) if c not in self.node_of]
            log.info("fedhet: %d SuperNode(s) host %d of %d clients (%.1f s)", len(self.partition_of),
                     len(self.node_of), k, time.monotonic() - t0)
            if missing:
                log.warning("fedhet: after node-timeout=%.0f s no SuperNode hosts clients %s; they will be "
                            "dropped from every round they are sampled in", self.flower.node_timeout, missing)
            if len(self.node_of) < self.flower.min_clients:
                raise FlowerRunError(
                    f"only {len(self.node_of)} of {k} clients have a SuperNode after node-timeout="
                    f"{self.flower.node_timeout:.0f} s (min-clients={self.flower.min_clients}); start one "
                    f"flower-supernode per partition with --node-config 'partition-id=I num-partitions=N'"
                    + (f"; node errors: {'; '.join(self.node_errors[:3])}" if self.node_errors else ""))

    def _identify(self, node_ids: list[int]) -> None:
        self.seen_nodes.update(node_ids)
        head: dict[str, Any] = {"query": "identify"}
        if self.restore and self.restore["clients"]:     # a resumed run: nodes load their commits first
            head.update({"run-key": self.run_key, "restore-round": self.restore["round"],
                         "restore-clients": json.dumps(sorted(self.restore["clients"]))})
        msgs = [FlowerMessage(RecordDict({"fedhet": ConfigRecord(head)}), dst_node_id=nid,
                              message_type="query.identify", group_id="identify", ttl=self.flower.phase_timeout)
                for nid in node_ids]
        replies, missing = self._send_and_receive(msgs, self.flower.phase_timeout)
        for nid, why in missing.items():
            log.warning("fedhet: SuperNode %s did not identify itself (%s); ignored", nid, why)
        for nid, reply in replies.items():
            if reply.has_error():
                log.warning("fedhet: SuperNode %s cannot act as a fedhet node: %s", nid, reply.error.reason)
                self.node_errors.append(f"node {nid}: {reply.error.reason}")
                continue
            ident = reply.content["identify"]
            pid, n = int(ident["partition-id"]), int(ident["num-partitions"])
            if self.num_partitions is None:
                self.num_partitions = n
            if n != self.num_partitions:
                log.warning("fedhet: SuperNode %s says num-partitions=%d, others %d; ignored", nid, n,
                            self.num_partitions)
                continue
            if pid in self.partition_of.values():
                log.warning("fedhet: SuperNode %s holds partition %d, which another node already holds; kept "
                            "as a standby", nid, pid)
                self.standby.add(nid)
                continue
            theirs = json.loads(str(ident.get("versions", "{}")))
            differ = [f"{k} {theirs.get(k) or 'unknown'} (server: {v})" for k, v in self.versions.items()
                      if theirs.get(k) != v and not (k == "fedhet-commit" and not (v and theirs.get(k)))]
            if differ:
                why = (f"SuperNode {nid} (partition {pid}) runs other versions: {', '.join(differ)}; install the "
                       f"server's fedhet, torch and flwr on every host")
                log.warning("fedhet: %s; ignored", why)
                self.node_errors.append(why)
                continue
            mine = Node(self.host, pid, n)
            if ident["fingerprint"] != mine.fingerprint():
                why = (f"SuperNode {nid} (partition {pid}) built a different federation than the server (its "
                       f"data files or config differ)")
                log.warning("fedhet: %s; ignored", why)
                self.node_errors.append(why)
                continue
            self.partition_of[nid] = pid
            for c in mine.clients:
                self.node_of[c] = nid
            self._record_training(nid, pid, json.loads(str(ident.get("training", "{}"))))
            if self.restore:
                self.restore["clients"] -= set(json.loads(str(ident.get("restored", "[]"))))

    def _record_training(self, nid: int, pid: int, theirs: dict[str, str]) -> None:
        """Keep how a node trains (summary.json: engine.nodes), and say where it is not how the
        server's summary records the run: ``auto`` settings resolve by each machine's hardware."""
        self.node_training[pid] = theirs
        server = training_of(self.host)
        differ = [f"{k} {theirs[k]} (server: {server[k]})" for k in ("precision", "memory_format")
                  if k in theirs and theirs[k] != server[k]]
        if differ:
            log.warning("fedhet: SuperNode %s (partition %d) trains its clients with %s: run.precision or "
                        "run.memory_format auto resolved otherwise on its hardware; summary.json's engine.nodes "
                        "records each node's; name fp32 or bf16 and a layout for one setting on every node",
                        nid, pid, ", ".join(differ))

    # --- two-sided checkpoints -------------------------------------------------------------
    def commit(self, done_rounds: int) -> dict[str, Any]:
        """Ask every node to commit its clients' state after round ``done_rounds``; returns what
        the server's checkpoint records of it. A node that does not commit is named in a
        warning: a resume from this checkpoint starts its clients over."""
        head: dict[str, Any] = {"query": "commit", "run-key": self.run_key, "round": done_rounds}
        if self.checkpointed_round is not None:
            head["keep-round"] = self.checkpointed_round
        nodes = sorted(set(self.node_of.values()))
        msgs = [FlowerMessage(RecordDict({"fedhet": ConfigRecord(head)}), dst_node_id=nid,
                              message_type="query.commit", group_id="commit", ttl=self.flower.phase_timeout)
                for nid in nodes]
        replies, missing = self._send_and_receive(msgs, self.flower.phase_timeout)
        committed: set[int] = set()
        for nid, reply in replies.items():
            if reply.has_error():
                missing[nid] = reply.error.reason
            else:
                committed.update(json.loads(str(reply.content["commit"]["clients"])))
        for nid, why in missing.items():
            log.warning("fedhet: SuperNode %s did not commit its clients' state after round %d (%s)", nid,
                        done_rounds, why)
        left = [c for c in range(self.federation.num_clients) if c not in committed]
        if left:
            log.warning("fedhet: round %d: no committed state for clients %s; a resume from this checkpoint "
                        "starts them over", done_rounds, left)
        return {"run_key": self.run_key, "committed": sorted(committed), "state_floats": dict(self.state_floats)}

    def restore_from(self, done_rounds: int, saved: dict[str, Any]) -> None:
        """Resume from the checkpoint of round ``done_rounds`` (``saved``: what :meth:`commit`
        returned then): the nodes will be asked to load their clients' commits."""
        self.run_key = saved["run_key"]
        self.checkpointed_round = done_rounds
        self.state_floats = {int(c): int(n) for c, n in saved["state_floats"].items()}
        self.restore = {"round": done_rounds, "clients": set(saved["committed"])}
        fresh = [c for c in range(self.federation.num_clients) if c not in self.restore["clients"]]
        if fresh:
            log.warning("fedhet: resuming after round %d; clients %s had no committed state and start over",
                        done_rounds, fresh)

    # --- messages -----------------------------------------------------------------------
    def _send_and_receive(self, msgs: list[FlowerMessage], timeout: float):
        """Push, then pull every poll-interval until all replied or ``timeout`` passed.

        Returns ``({dst node id: reply}, {dst node id without reply: why})``. A node Flower stops
        listing while we wait (its SuperNode died) is given up at once instead of at the timeout."""
        if not msgs:
            return {}, {}
        ids = list(self.grid.push_messages(msgs))
        if len(ids) != len(msgs):
            raise FlowerRunError(f"the SuperLink accepted {len(ids)} of {len(msgs)} messages")
        pending = {mid: m.metadata.dst_node_id for mid, m in zip(ids, msgs)}
        replies: dict[int, FlowerMessage] = {}
        missing: dict[int, str] = {}
        end = time.monotonic() + timeout
        next_check = time.monotonic() + 5.0
        while pending:
            for r in self.grid.pull_messages(list(pending)):
                nid = pending.pop(r.metadata.reply_to_message_id, None)
                if nid is not None:
                    replies[nid] = r
            now = time.monotonic()
            if not pending or now >= end:
                break
            if now >= next_check:
                listed = set(self.grid.get_node_ids())
                for mid in [m for m, n in pending.items() if n not in listed]:
                    missing[pending.pop(mid)] = "its SuperNode left the federation"
                next_check = now + 5.0
            time.sleep(min(self.flower.poll_interval, max(0.0, end - now)))
        missing.update({n: f"no reply within {timeout:g} s" for n in pending.values()})
        return replies, missing

    def deliver(self, rnd: int, jobs: list[Job]) -> dict[int, JobResult]:
        """One phase: one message per node with all its clients' messages, replies back; drops
        the clients whose node is silent or whose update failed."""
        if rnd != self.last_round:           # a new round: find new nodes, start its record
            self.round_info = {}
            self.last_round = rnd
            self.phase_no = 0
            t = time.perf_counter()
            self.discover()
            self.round_info["discover_seconds"] = round(time.perf_counter() - t, 4)
        self.phase_no += 1
        phase_no = self.phase_no
        phase = {job.cid: job.message for job in jobs}
        tallies = {job.cid: job.tally for job in jobs}
        t0 = time.perf_counter()
        replies: dict[int, JobResult] = {}
        dropped: dict[int, str] = {}
        client_seconds: dict[str, float] = {}
        node_profiles: list[dict[str, float]] = []
        per_node: dict[int, list[int]] = defaultdict(list)
        for cid in phase:
            if cid in self.node_of:
                per_node[self.node_of[cid]].append(cid)
            else:
                dropped[cid] = f"phase {phase_no}: no SuperNode hosts this client"
        # One message per node: a SuperNode reads a run's context.state when a task starts and
        # writes it when it ends, so two concurrent tasks on one node would lose one client's
        # state update (flwr supernode runtime_handlers); one task for all its clients cannot.
        msgs, down_bytes = [], 0
        for nid, cids in per_node.items():
            rd = codec.encode_batch({c: phase[c] for c in cids}, rnd)
            down_bytes += rd["batch.tensors"].count_bytes()
            kinds = {phase[c].kind for c in cids}
            mtype = codec.message_type(kinds.pop()) if len(kinds) == 1 else "train"
            msgs.append(FlowerMessage(rd, dst_node_id=nid, message_type=mtype, group_id=str(rnd + 1),
                                      ttl=self.flower.phase_timeout))
        got, missing = self._send_and_receive(msgs, self.flower.phase_timeout)
        up_bytes = 0
        for nid, why in missing.items():
            for cid in per_node[nid]:
                dropped[cid] = f"phase {phase_no}: {why}"
        for nid, r in got.items():
            if r.has_error():
                for cid in per_node[nid]:
                    dropped[cid] = f"phase {phase_no}: error on its node: {r.error.reason}"
                continue
            up_bytes += r.content["batch.tensors"].count_bytes()
            answers, _ = codec.decode_batch(r.content)
            node_profiles.append(dict(r.content["profile"]))
            errors = json.loads(r.content["errors"]["json"])
            stats = r.content["stats"]
            for cid in per_node[nid]:
                if str(cid) in errors:
                    dropped[cid] = f"phase {phase_no}: error on its node: {errors[str(cid)]}"
                elif cid not in answers:
                    dropped[cid] = f"phase {phase_no}: its node's reply leaves it out"
            for i, (cid, reply) in enumerate(answers.items()):
                if cid not in per_node[nid]:
                    raise FlowerRunError(f"round {rnd + 1}, phase {phase_no}: node {nid} replied for client {cid}, "
                                         f"which it was not sent")
                before = tallies[cid]
                tally = Tally(before.samples + int(stats["samples"][i]), before.loss_sum, before.steps)
                if int(stats["steps"][i]):
                    tally.loss_sum = (before.loss_sum or 0.0) + float(stats["loss_sum"][i])
                    tally.steps = before.steps + int(stats["steps"][i])
                self.state_floats[cid] = int(stats["state_floats"][i])
                client_seconds[str(cid)] = round(float(stats["seconds"][i]), 3)
                replies[cid] = JobResult(reply, None, tally)
        for cid, why in dropped.items():
            log.warning("fedhet: round %d: client %d dropped from the round (%s)", rnd + 1, cid, why)
            self.round_info.setdefault("dropped", {})[str(cid)] = why
        kinds = sorted({m.kind for m in phase.values()})
        self.round_info.setdefault("phases", []).append({
            "phase": phase_no, "kinds": kinds, "sent": sum(map(len, per_node.values())), "answered": len(replies),
            # the tensors' bytes as sent: once a node (a tensor shared by its clients once), not per client
            "messages": len(msgs), "down_bytes": down_bytes, "up_bytes": up_bytes,
            "seconds": round(time.perf_counter() - t0, 4),
            "client_seconds": client_seconds,      # inside the ClientApp handler; the rest is Flower
            "node_profiles": node_profiles})       # client_app.profile of each node that answered
        need = min(self.flower.min_clients, len(phase))
        if len(replies) < need:
            causes = "; ".join(f"client {c}: {why}" for c, why in dropped.items())
            raise TooFewClientsError(
                f"round {rnd + 1}, phase {phase_no} ({'/'.join(kinds)}): {len(replies)} of {len(phase)} clients "
                f"answered, fewer than min-clients={self.flower.min_clients} ({causes})")
        return replies

    # --- evaluation -----------------------------------------------------------------------
    def evaluate_clients(self, rnd: int, batch_size: int, client_view: Callable[[int], State],
                         clients: list[int] | None = None, precision: str = "fp32") -> dict[str, Any]:
        """Personalized metrics of metrics/evaluate.py, computed from the clients' own reports
        (of ``clients``, default all: eval.clients; forward passes in ``precision``)."""
        t0 = time.perf_counter()
        k = self.federation.num_clients
        chosen = list(range(k)) if clients is None else list(clients)
        correct = np.full(k, np.nan)
        total = np.full(k, np.nan)
        loss = np.full(k, np.nan)              # summed cross-entropy (a node of an older fedhet sends none)
        failed: dict[str, str] = {str(c): "no SuperNode hosts this client" for c in chosen if c not in self.node_of}
        # One message per node for all its clients: evaluation leaves client state unchanged, and
        # one process per node tests them all (one torch start-up instead of one per client).
        per_node: dict[int, list[int]] = defaultdict(list)
        for c in chosen:
            if c in self.node_of:
                per_node[self.node_of[c]].append(c)
        msgs = []
        nbytes = 0
        for nid, cids in per_node.items():
            rd = RecordDict({"fedhet": ConfigRecord({"cids": cids, "round": rnd, "batch-size": batch_size,
                                                   "precision": precision})})
            codec.tree_to_records({c: client_view(c) for c in cids}, rd, "server")   # shared tensors sent once
            nbytes += rd["server.tensors"].count_bytes()
            msgs.append(FlowerMessage(rd, dst_node_id=nid, message_type="evaluate", group_id=str(rnd + 1),
                                      ttl=self.flower.phase_timeout))
        got, missing = self._send_and_receive(msgs, self.flower.phase_timeout)
        for nid, why in missing.items():
            for c in per_node[nid]:
                failed[str(c)] = why
        node_profiles = []
        for nid, r in got.items():
            if r.has_error():
                for c in per_node[nid]:
                    failed[str(c)] = f"error on its node: {r.error.reason}"
                continue
            node_profiles.append(dict(r.content["profile"]))
            rec = r.content["eval"]
            for c, hit, n in zip(per_node[nid], rec["correct"], rec["total"]):
                correct[c], total[c] = hit, n
            if "loss" in rec:
                for c, value in zip(per_node[nid], rec["loss"]):
                    loss[c] = value
        for c, why in failed.items():
            log.warning("fedhet: round %d: client %s not evaluated (%s)", rnd + 1, c, why)
        self.round_info["evaluate"] = {"answered": int(np.isfinite(total).sum()), "down_bytes": int(nbytes),
                                       "seconds": round(time.perf_counter() - t0, 4), "node_profiles": node_profiles}
        if failed:
            self.round_info["not_evaluated"] = failed
        ok = np.isfinite(total)
        if not ok.any():
            return {}
        answered = [c for c in range(k) if ok[c]]
        return personal_metrics(correct, total, loss if np.isfinite(loss[ok]).all() else None, answered)

    def client_state_floats(self) -> int:
        return sum(self.state_floats.values())


class FlowerCallback(Callback):
    """What a Flower run adds to the rows and the summary, and its log lines."""

    def __init__(self, transport: GridTransport, flower: FlowerSettings):
        self.transport = transport
        self.flower = flower

    def on_row(self, exp: RunView, row: dict) -> None:
        # The loop counts client state it holds; on Flower it is on the nodes, which report it.
        row["client_state_floats"] = self.transport.client_state_floats()
        row["flower"] = self.transport.round_info

    def on_row_written(self, exp: RunView, row: dict) -> None:
        phases = ", ".join(f"{'/'.join(p['kinds'])} {p['answered']}/{p['sent']} in {p['seconds']:.1f} s"
                           for p in row["flower"].get("phases", []))
        shown = {k: round(row[k], 4) for k in ("global_acc", "personal_acc") if row.get(k) is not None}
        log.info("fedhet: round %d/%d: %s; %s", row["round"], exp.cfg.train.rounds, phases, shown or "not evaluated")

    def on_summary(self, exp: RunView, summary: dict) -> None:
        t = self.transport
        causes = drop_causes(read_metrics(exp.run_dir))
        summary["flower"] = {**asdict(self.flower), "nodes": len(t.partition_of), "clients_with_node": len(t.node_of),
                             "dropped_clients": sum(causes.values()), "drop_causes": causes}
        if causes:     # a run that ends "completed" with clients left out says so once at its end
            log.warning("fedhet: %d client update(s) were dropped over the run: %s", sum(causes.values()),
                        "; ".join(f"{n} x {cause}" for cause, n in causes.items()))


def drop_causes(rows: list[dict]) -> dict[str, int]:
    """How many client updates each cause dropped over the rows (``flower.dropped`` of each round,
    "phase N: CAUSE", where the full messages stay), across resumes. An error on a node counts
    under its exception type, so one failure repeated over rounds and clients is one entry."""
    causes: dict[str, int] = {}
    error = "error on its node: "
    for row in rows:
        for why in (row.get("flower") or {}).get("dropped", {}).values():
            cause = (why.split(": ", 1)[-1].splitlines() or [""])[0]
            if cause.startswith(error):
                cause = error + cause[len(error):].split(":", 1)[0]
            causes[cause[:200]] = causes.get(cause[:200], 0) + 1
    return causes


def flower_experiment(cfg: ExperimentConfig, run_dir, grid: Grid, flower: FlowerSettings,
                      resume: bool = False) -> Experiment:
    """An :class:`Experiment` whose clients are Flower SuperNodes (see the module docstring);
    ``resume``: continue the run in ``run_dir`` from its checkpoint."""
    if cfg.train.clients_per_round < flower.min_clients:
        raise ConfigError(f"min-clients={flower.min_clients} exceeds train.clients_per_round="
                          f"{cfg.train.clients_per_round}: no round could complete")
    if cfg.run.client_state_store != "auto" or cfg.run.client_state_memory_mb is not None:
        warnings.warn("run.client_state_store and run.client_state_memory_mb are the simulator's: on Flower each "
                      "node keeps its clients' states in its node-state file", stacklevel=2)
    built = build(cfg)
    transport = GridTransport(grid, flower)
    loop = RoundLoop(built.host, cfg.train.clients_per_round, transport)

    def evaluate_round(exp: Experiment, rnd: int) -> dict:
        batch = cfg.eval.batch_size
        # global test set, on the server; the uploaded local models too with eval.local_risk
        out = evaluate_loop(loop, batch, personalized=False, local_models=exp.local_models,
                            precision=exp.eval_precision)
        if cfg.eval.personalized:
            out.update(transport.evaluate_clients(rnd, batch, lambda cid: exp.algorithm.client_view(
                loop.server_state, cid), exp.eval_clients(rnd), exp.eval_precision))
        return out

    def checkpoint(exp: Experiment, done_rounds: int) -> None:
        # The nodes commit first: a checkpoint.pt on disk means its round's node state is too.
        exp.checkpoint(done_rounds, engine="flower", flower=transport.commit(done_rounds))
        transport.checkpointed_round = done_rounds

    parts: dict[str, Any] = dict(built=built, loop=loop, callbacks=[FlowerCallback(transport, flower)],
                                 evaluator=evaluate_round, checkpointer=checkpoint)
    if not resume:
        if run_dir and RunDir(run_dir).holds_run():       # the simulator's advice would not fit a deployment
            raise ConfigError(f"{run_dir} already holds a run: to continue it, submit the run config of "
                              f"`fedhet flower app --resume {run_dir} --out APP` (resume = true; on one machine: "
                              f"`fedhet flower run --resume {run_dir}`), or give another run-dir")
        return Experiment.create(cfg, run_dir, **parts)
    if not run_dir:
        raise ConfigError("resuming a Flower run needs its run directory (run-config key run-dir)")
    exp = Experiment.resume(run_dir, config=cfg, **parts)
    if exp.restored is not None:          # Experiment.resume refused a checkpoint of the simulator
        transport.restore_from(exp.start_round, exp.restored["flower"])
    return exp


def load_server_state(run_dir) -> dict:
    """The server state a Flower run directory holds: ``{"round", "engine", "server_state"}``
    (from ``checkpoint.pt``; runs of older fedhet versions wrote ``server_state.pt``)."""
    legacy = os.path.join(run_dir, LEGACY_SERVER_STATE)
    if os.path.exists(legacy) and not os.path.exists(os.path.join(run_dir, CHECKPOINT)):
        return torch.load(legacy, weights_only=False)
    snap = torch.load(os.path.join(run_dir, CHECKPOINT), weights_only=False)
    return {"round": snap["round"], "engine": snap.get("engine"), "server_state": snap["sim"]["server_state"]}


__all__ = ["FlowerCallback", "FlowerRunError", "FlowerSettings", "GridTransport", "TooFewClientsError",
           "flower_experiment", "load_server_state"]
