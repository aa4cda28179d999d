"""Semantic mutation: each listed input of a seed method swapped for its plausible wrong neighbour
(the received model for the locally trained one, a constant for the configured value, ...), one
patch at a time, against the method's tests. A swap the tests do not fail on is a gap.

    .venv/bin/python scripts/wiring_mutants.py                  # every listed swap
    .venv/bin/python scripts/wiring_mutants.py --method fedacd  # one method's
    .venv/bin/python scripts/wiring_mutants.py --list           # the list: input, equation, test

Each swap is a text replacement in one source file, applied to this checkout's tree, run, and
undone (also when interrupted); runs started meanwhile from the same tree would import the swapped
file, so run it in a checkout of its own (``git worktree add``) while anything else uses this one.
``--python`` names the interpreter (default: this checkout's .venv). It writes
benchmarks/results/wiring_mutants.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Swap:
    method: str
    input: str          # what the step reads, in the paper's terms
    where: str          # equation or section of the paper
    wrong: str          # the plausible wrong neighbour the patch puts in its place
    file: str
    old: str
    new: str
    tests: str          # the test file(s) run against it


FCA = "src/fedhet/algorithms/fedclassavg.py"
ACD = "src/fedhet/algorithms/fedacd.py"
FCA_TESTS = "tests/algorithms/test_fedclassavg.py"
ACD_TESTS = "tests/algorithms/test_fedacd.py"
REMA = "src/fedhet/algorithms/fedrema.py"
REMA_TESTS = "tests/algorithms/test_fedrema.py"
CME = "src/fedhet/algorithms/fedcme.py"
CME_TESTS = "tests/algorithms/test_fedcme.py"
FM = "src/fedhet/algorithms/fedfm.py"
FM_TESTS = "tests/algorithms/test_fedfm.py"

SWAPS = [
    # FedClassAvg (Jang et al., ICPP 2022)
    Swap("fedclassavg", "the proximal anchor: the received global classifier", "Eq. 4, L_R",
         "the client's own classifier from its last round", FCA,
         'result = client.train(weights, self.terms(msg.arrays["head"]), augment=augment)',
         'result = client.train(weights, self.terms(select(state["model"], HEAD) if state and "model" in state '
         'else msg.arrays["head"]), augment=augment)', FCA_TESTS),
    Swap("fedclassavg", "rho, the proximal weight", "Eq. 4, Table 1", "the default 0.4662 whatever is configured",
         FCA, "out.append(HeadProximal(anchor, p.rho))", "out.append(HeadProximal(anchor, 0.4662))", FCA_TESTS),
    Swap("fedclassavg", "the SupCon temperature", "Eq. 4, L_CL (the code's 100)", "the default whatever is configured",
         FCA, "SupervisedContrastive(p.temperature, p.base_temperature)",
         "SupervisedContrastive(100.0, p.base_temperature)", FCA_TESTS),
    Swap("fedclassavg", "the SupCon base temperature", "Eq. 4, L_CL (the code's 0.07)",
         "the default whatever is configured", FCA, "SupervisedContrastive(p.temperature, p.base_temperature)",
         "SupervisedContrastive(p.temperature, 0.07)", FCA_TESTS),
    Swap("fedclassavg", "the classifier a client starts its round from: the global one", "Sec. 4.1",
         "its own previous classifier (the global one never loaded)", FCA,
         'weights = {**weights, **msg.arrays["head"], **(msg.arrays.get("body") or {})}',
         'weights = {**weights, **(msg.arrays.get("body") or {})}', FCA_TESTS),
    Swap("fedclassavg", "what is averaged: the classifiers only", "Sec. 4.1",
         "the whole uploaded model (bodies too)", FCA,
         'uploads = {"head": select(result.weights, HEAD)}', 'uploads = {"head": dict(result.weights)}', FCA_TESTS),
    Swap("fedclassavg", "the averaging weights: the clients' sample sizes", "Sec. 4.1", "uniform weights", FCA,
         'sizes = [float(replies[c].scalars["num_samples"]) for c in cids]', "sizes = [1.0 for c in cids]", FCA_TESTS),
    Swap("fedclassavg", "the evaluated model: the client's own last trained model", "Sec. 5 (the code)",
         "the new global classifier on the client's body", FCA,
         'return client_state["model"] if client_state and "model" in client_state else None',
         'return {**client_state["model"], **state["head"]} if client_state and "model" in client_state else None',
         FCA_TESTS),
    Swap("fedclassavg", "the pre-training epoch's batch order: its own stream after the round's epochs", "[C]",
         "the round's first epoch's stream again", FCA, "start_epoch=client.settings.epochs)", "start_epoch=0)",
         FCA_TESTS),
    # FedACD (Zhou et al.)
    Swap("fedacd", "epoch 0's P: the received model on the client's data", "Sec. 4.1",
         "the identity matrix (no estimate)", ACD,
         "P, _ = local_probability_matrix(client.model, weights, client.data, num_classes,\n"
         "                                            fast_passes=trains_in_channels_last(client.settings))\n"
         "        options",
         "P = torch.eye(num_classes, dtype=torch.float64, device=present.device)\n        options", ACD_TESTS),
    Swap("fedacd", "each later epoch's P: the previous epoch's estimate", "Sec. 4.1",
         "epoch 0's P all round", ACD,
         'P = probability_matrix(result.statistics["adjusted_ce.sums"], result.statistics["adjusted_ce.counts"])',
         "P = P", ACD_TESTS),
    Swap("fedacd", "lambda, the weight of L2", "Eq. 9", "1 whatever is configured", ACD,
         "MarginAdjustedCE(log_delta, p.margin_weight)", "MarginAdjustedCE(log_delta, 1.0)", ACD_TESTS),
    Swap("fedacd", "delta_missing, Delta of a class the client lacks", "Eq. 8 and after",
         "the default whatever is configured", ACD,
         "log_delta = log_adjustment(P, present, p.delta_missing, p.prob_floor, p.log_delta_clip)",
         "log_delta = log_adjustment(P, present, 1e-2, p.prob_floor, p.log_delta_clip)", ACD_TESTS),
    Swap("fedacd", "the mixed pair's form of Eq. 7 (flatten_mixed)", "Eq. 7 [D]", "the default whatever is configured",
         ACD, "Flattening(p.detach_target, p.flatten_mixed)", "Flattening(p.detach_target)", ACD_TESTS),
    Swap("fedacd", "the score's template tau", "Eq. 10-11", "the default whatever is configured", ACD,
         'kl = template_kl(result.statistics["fedacd.P"], present, self.params.template_tau)',
         'kl = template_kl(result.statistics["fedacd.P"], present)', ACD_TESTS),
    Swap("fedacd", "the score's P: the trained local model's (the last epoch's estimate, or the clean pass)",
         "Eq. 10", "the received model's P", ACD, 'final.statistics["fedacd.P"] = P',
         'final.statistics["fedacd.P"] = (local_probability_matrix(client.model, msg.arrays["model"], client.data, '
         'num_classes)[0] if present.any() else P)', ACD_TESTS),
    Swap("fedacd", "the aggregation weights: the scores V", "Eq. 11", "the sample sizes (FedAvg's)", ACD,
         'return [float(replies[c].scalars["score"]) for c in cids]', "return super().aggregation_weights(replies, cids)",
         ACD_TESTS),
    # FedReMa (Liang et al.)
    Swap("fedrema", "the model client k starts its round from: {theta, phi_k}, its own classifier", "Alg. 2 line 3",
         "the shared model (its classifier never loaded)", REMA,
         'msg = Message("train", {"model": self.personal_model(state, cid)})',
         'msg = Message("train", {"model": state["model"]})', REMA_TESTS),
    Swap("fedrema", "the probe h~: drawn afresh every round", "Sec. 4.1", "the first round's probe kept", REMA,
         'state["probe_seed"] = int(ctx.rng.integers(2**62))',
         'state["probe_seed"] = state.get("probe_seed", int(ctx.rng.integers(2**62)))', REMA_TESTS),
    Swap("fedrema", "the probe h~: one for every client of the round", "Sec. 4.1",
         "one per client (the reference's draw per row)", REMA,
         'probe = probe_feature(int(msg.scalars["probe_seed"]), client.model.feature_dim)',
         'probe = probe_feature(int(msg.scalars["probe_seed"]) + client.cid, client.model.feature_dim)', REMA_TESTS),
    Swap("fedrema", "the probe's distribution U[0,1)^d", "Sec. 4.1", "U[0,0.5)^d (the reference code's)", REMA,
         "return torch.rand(dim, generator=g)", "return 0.5 * torch.rand(dim, generator=g)", REMA_TESTS),
    Swap("fedrema", "phi_k of the soft logits: the locally trained classifier it uploads", "Sec. 4.1, Eq. 5",
         "the received classifier", REMA,
         "p = soft_logits(client.model, select(result.weights, HEAD), probe, self.params.temperature)",
         'p = soft_logits(client.model, select(msg.arrays["model"], HEAD), probe, self.params.temperature)',
         REMA_TESTS),
    Swap("fedrema", "M, the soft logits' temperature", "Sec. 4.1", "the default 0.5 whatever is configured", REMA,
         "p = soft_logits(client.model, select(result.weights, HEAD), probe, self.params.temperature)",
         "p = soft_logits(client.model, select(result.weights, HEAD), probe, 0.5)", REMA_TESTS),
    Swap("fedrema", "M applied to every client's logits", "Sec. 4.1", "plain softmax (the reference's peers' T=1)",
         REMA, "torch.softmax(logits.double() / temperature, dim=1)", "torch.softmax(logits.double(), dim=1)",
         REMA_TESTS),
    Swap("fedrema", "s_k, client k's own relevance vector", "Alg. 2 line 12", "the first uploaded client's row",
         REMA, "members, gap = mds(sim[pos], pos)", "members, gap = mds(sim[0], pos)", REMA_TESTS),
    Swap("fedrema", "the feature extractors' weights |D_i|", "Eq. 6", "uniform weights", REMA,
         "body = weighted_average([select(models[c], BODY) for c in cids],\n"
         "                                self.aggregation_weights(replies, cids))",
         "body = weighted_average([select(models[c], BODY) for c in cids],\n"
         "                                [1.0 for c in cids])", REMA_TESTS),
    Swap("fedrema", "theta^(t): the round's averaged feature extractor", "Eq. 6, Alg. 2 line 23",
         "the previous round's extractor kept", REMA, 'state["model"] = {**state["model"], **body}',
         'state["model"] = {**body, **state["model"]}', REMA_TESTS),
    Swap("fedrema", "the classifiers of A_k: this round's uploads phi^_i", "Eq. 7",
         "the classifiers already personalized earlier in the same loop", REMA,
         "new_heads[k] = weighted_average([heads[i] for i in A], w)",
         "new_heads[k] = weighted_average([new_heads.get(i, heads[i]) for i in A], w)", REMA_TESTS),
    Swap("fedrema", "the classifiers' weights |D_i| (head_weighting: samples)", "Eq. 7", "uniform weights", REMA,
         'w = [sizes[i] if self.params.head_weighting == "samples" else 1.0 for i in A]', "w = [1.0 for i in A]",
         REMA_TESTS),
    Swap("fedrema", "G[k, i]: the counts of the earlier rounds plus this one", "Alg. 2 line 16",
         "this round's selections only", REMA, "row[i] = row.get(i, 0) + 1", "row[i] = 1", REMA_TESTS),
    Swap("fedrema", "the CCP ratio's denominator: the largest mean gap so far", "Eq. 9",
         "this round's mean gap", REMA, 'ccp_continues(state["gaps"], self.params.delta)',
         'ccp_continues(state["gaps"][-1:], self.params.delta)', REMA_TESTS),
    Swap("fedrema", "delta, the CCP threshold", "Eq. 9", "the default 0.5 whatever is configured", REMA,
         'ccp_continues(state["gaps"], self.params.delta)', 'ccp_continues(state["gaps"], 0.5)', REMA_TESTS),
    Swap("fedrema", "the classifiers of Eq. 10: this round's uploads phi^_i", "Eq. 10",
         "the personalized classifiers of the last round", REMA, "avg = dependency_average(heads, G.get(k, {}))",
         'avg = dependency_average(state["heads"], G.get(k, {}))', REMA_TESTS),
    Swap("fedrema", "a client with no dependency on this round's uploads: its own uploaded classifier",
         "Eq. 10 (partial participation)", "its last personalized classifier", REMA,
         "new_heads[k] = avg if avg is not None else heads[k]",
         'new_heads[k] = avg if avg is not None else state["heads"].get(k, heads[k])', REMA_TESTS),
    Swap("fedrema", "the evaluated model: {theta, phi_k}", "Alg. 2 line 23, Sec. 5", "the shared model", REMA,
         "return self.personal_model(state, cid)", 'return state["model"]', REMA_TESTS),
    Swap("fedrema", "the SGD momentum: kept across rounds", "Sec. 5 (the code)", "a fresh optimizer every round",
         REMA, "keeps_optimizer_state = True", "keeps_optimizer_state = False", REMA_TESTS),
    Swap("fedrema", "+F: the uploaded class means: of the locally trained model", "Eq. 11 (FedPAC)",
         "of the received model", REMA,
         "means, counts = class_means(client.model, result.weights, client.data, client.num_classes,",
         'means, counts = class_means(client.model, msg.arrays["model"], client.data, client.num_classes,',
         REMA_TESTS),
    Swap("fedrema", "+F: the prototypes' average: uniform over clients with the class", "Sec. 5 (the code)",
         "weighted by class counts", REMA, 'agg = aggregate_prototypes(uploads, "uniform")',
         'agg = aggregate_prototypes(uploads, "counts")', REMA_TESTS),
    Swap("fedrema", "+F: lambda, the alignment weight", "Eq. 11", "1 whatever is configured", REMA,
         "terms.append(PrototypeAlignment(*received, self.params.align_weight))",
         "terms.append(PrototypeAlignment(*received, 1.0))", REMA_TESTS),
    # FedCME (Nie, Xiao, Yang and Wu)
    Swap("fedcme", "the matching's order: by cos(eps_k, eps_g) ascending (least typical first)", "Alg. 1 line 17",
         "descending (most typical first)", CME,
         "return sorted(clients, key=lambda k: cosine(vectors.get(k), g))",
         "return sorted(clients, key=lambda k: -cosine(vectors.get(k), g))", CME_TESTS),
    Swap("fedcme", "eps_g: the mean of the sampled clients' vectors", "Alg. 1 line 15",
         "the first sampled client's vector", CME,
         "g = torch.stack([v.double().flatten() for v in present]).sum(0) / len(clients)",
         "g = present[0].double().flatten()", CME_TESTS),
    Swap("fedcme", "the counterpart j: the least similar remaining client", "Alg. 1 line 20",
         "the most similar one", CME, "j = min(remaining, key=lambda c: cosine(vectors.get(k), vectors.get(c)))",
         "j = max(remaining, key=lambda c: cosine(vectors.get(k), vectors.get(c)))", CME_TESTS),
    Swap("fedcme", "FedCME-MTO's source: the least similar other client", "Sec. V-B", "the most similar one", CME,
         "out[k] = min(others, key=lambda c: cosine(vectors.get(k), vectors.get(c))) if others else None",
         "out[k] = max(others, key=lambda c: cosine(vectors.get(k), vectors.get(c))) if others else None", CME_TESTS),
    Swap("fedcme", "eps^t: every client's last uploaded evaluation vector", "Alg. 1 line 28",
         "its first one kept", CME, 'evals[c] = replies[c].arrays["evaluation"]["accuracy"]',
         'evals.setdefault(c, replies[c].arrays["evaluation"]["accuracy"])', CME_TESTS),
    Swap("fedcme", "phase A's length: floor(E/2) epochs", "Alg. 2 line 4", "ceil(E/2) epochs", CME,
         "result, stats = self.train_phase(weights, msg, base, client, E // 2 if two_phase else E, 0)",
         "result, stats = self.train_phase(weights, msg, base, client, (E + 1) // 2 if two_phase else E, 0)",
         CME_TESTS),
    Swap("fedcme", "phase B's batches: epochs floor(E/2)..E-1 of the round's stream", "Alg. 2 line 3",
         "the stream's first epochs again", CME,
         'result, stats = self.train_phase(weights, train_msg, state, client, E - E // 2, E // 2, mid.get("acc"))',
         'result, stats = self.train_phase(weights, train_msg, state, client, E - E // 2, 0, mid.get("acc"))',
         CME_TESTS),
    Swap("fedcme", "the part handed over: the classifier", "Alg. 2 lines 22-24", "the feature extractor", CME,
         "return select(weights, HEAD)", "return select(weights, BODY)", CME_TESTS),
    Swap("fedcme", "the part received: the counterpart j's", "Alg. 2 line 24", "the client's own", CME,
         'part = replies[j].arrays.get("exchange") if j is not None and j in replies else None',
         'part = replies[k].arrays.get("exchange") if j is not None and j in replies else None', CME_TESTS),
    Swap("fedcme", "phase B's model: (theta_k, phi_j)", "Alg. 2 line 24", "(theta_k, phi_k): the swap ignored", CME,
         'weights = {**mid["weights"], **part}', 'weights = {**part, **mid["weights"]}', CME_TESTS),
    Swap("fedcme", "phase B's alignment target: the round's global features zeta^t", "Eq. 9-10, Alg. 2 line 13",
         "none (the exchange message's arrays)", CME,
         'result, stats = self.train_phase(weights, train_msg, state, client, E - E // 2, E // 2, mid.get("acc"))',
         'result, stats = self.train_phase(weights, msg, state, client, E - E // 2, E // 2, mid.get("acc"))',
         CME_TESTS),
    Swap("fedcme", "zeta_k: features accumulated over all E epochs", "Alg. 2 lines 12, 18", "phase B's epochs only",
         CME,
         'result, stats = self.train_phase(weights, train_msg, state, client, E - E // 2, E // 2, mid.get("acc"))',
         "result, stats = self.train_phase(weights, train_msg, state, client, E - E // 2, E // 2, None)",
         CME_TESTS),
    Swap("fedcme", "mu, the alignment weight", "Eq. 10", "the default 0.01 whatever is configured", CME,
         "terms.append(FeatureAlignment(self.params.mu, client.num_classes,",
         "terms.append(FeatureAlignment(0.01, client.num_classes,", CME_TESTS),
    Swap("fedcme", "the classes aligned: in the batch with a defined zeta[c]", "Eq. 9, decision 3",
         "every class in the batch (undefined ones to a zero row)", CME,
         "use = ((class_counts > 0) & self.defined.to(h.device)).unsqueeze(1)",
         "use = (class_counts > 0).unsqueeze(1)", CME_TESTS),
    Swap("fedcme", "the batch's class feature: the mean over B_c", "Eq. 9", "the sum over B_c", CME,
         "means = class_sums / class_counts.clamp(min=1).unsqueeze(1)", "means = class_sums", CME_TESTS),
    Swap("fedcme", "eps_k's model: the final (swapped) local model", "Eq. 4, Alg. 2 line 20",
         "the received global model", CME,
         'arrays["evaluation"] = {"accuracy": evaluation_vector(client.model, result.weights, client.data,',
         'arrays["evaluation"] = {"accuracy": evaluation_vector(client.model, msg.arrays["model"], client.data,',
         CME_TESTS),
    Swap("fedcme", "D_eval: eval_fraction of the training split", "Alg. 2 line 19",
         "the default 0.2 whatever is configured", CME,
         'positions = eval_subset(client.num_samples, self.params.eval_fraction, client.generator("eval_subset"))',
         'positions = eval_subset(client.num_samples, 0.2, client.generator("eval_subset"))', CME_TESTS),
    Swap("fedcme", "D_eval: drawn afresh by each client each round", "Alg. 2 line 19",
         "one fixed draw (the same positions every round)", CME,
         'positions = eval_subset(client.num_samples, self.params.eval_fraction, client.generator("eval_subset"))',
         "positions = eval_subset(client.num_samples, self.params.eval_fraction, torch.Generator().manual_seed(0))",
         CME_TESTS),
    Swap("fedcme", "zeta^t[c] for a client without class c (memory)", "Alg. 1 lines 29-33",
         "no memory: the mean over the clients with the class", CME,
         'return aggregate_prototypes(uploads, "uniform", previous=(prev, prev_defined))',
         'return aggregate_prototypes(uploads, "uniform")', CME_TESTS),
    Swap("fedcme", "zeta^(t+1): the unweighted mean over the clients", "Alg. 1 line 35",
         "weighted by class counts", CME,
         'return aggregate_prototypes(uploads, "uniform", previous=(prev, prev_defined))',
         'return aggregate_prototypes(uploads, "counts", previous=(prev, prev_defined))', CME_TESTS),
    # FedFM (Ye et al., IEEE TSP 2023)
    Swap("fedfm", "the local anchors' model: the received w^t with the client's own BatchNorm statistics "
         "(bn_buffers: local)", "Eq. 8", "w^t as sent (the global statistics)", FM,
         'reply = Message("anchors", {"anchors": self.anchor_upload(weights, client)},',
         'reply = Message("anchors", {"anchors": self.anchor_upload(msg.arrays["model"], client)},', FM_TESTS),
    Swap("fedfm", "the anchors trained against: this round's A^(t)", "Alg. 1, Eq. 10",
         "the previous round's anchors", FM,
         "state = self.update_anchors(dict(state), replies)                  # Eq. 9\n        phase = {}\n"
         "        for cid in ctx.clients:\n            if cid not in replies:\n"
         "                continue                                                   # dropped in the anchor phase\n"
         "            msg = self.train_message(state, cid, ctx)",
         "stale = dict(state)\n        state = self.update_anchors(dict(state), replies)\n        phase = {}\n"
         "        for cid in ctx.clients:\n            if cid not in replies:\n                continue\n"
         '            msg = self.train_message({**state, "anchors": stale["anchors"], '
         '"anchors_defined": stale["anchors_defined"]}, cid, ctx)', FM_TESTS),
    Swap("fedfm", "Eq. 9's weights: the class counts (anchor_weighting: weighted)", "Eq. 9",
         "uniform whatever is configured", FM,
         'return aggregate_prototypes(uploads, "counts" if weighting == "weighted" else "uniform",',
         'return aggregate_prototypes(uploads, "uniform",', FM_TESTS),
    Swap("fedfm", "anchor_weighting: uniform (Table VIII)", "Table VIII", "weighted whatever is configured", FM,
         'return aggregate_prototypes(uploads, "counts" if weighting == "weighted" else "uniform",',
         'return aggregate_prototypes(uploads, "counts",', FM_TESTS),
    Swap("fedfm", "a class no participant has: its previous anchor", "Sec. IV (decision 11)",
         "no memory (undefined)", FM, "previous=(prev, prev_defined))", "previous=None)", FM_TESTS),
    Swap("fedfm", "lambda, the weight of L_FM", "Eq. 10", "the default 50 whatever is configured", FM,
         'terms.append(AnchorMatching(anchors["mean"], anchors["defined"], self.params.lam,',
         'terms.append(AnchorMatching(anchors["mean"], anchors["defined"], 50.0,', FM_TESTS),
    Swap("fedfm", "alpha, the CG temperature", "Sec. IV-C", "the default 0.1 whatever is configured", FM,
         "self.params.matching, self.params.temperature))", "self.params.matching, 0.1))", FM_TESTS),
    Swap("fedfm", "the matching loss: cg or l2 as configured", "Sec. IV-C, Eq. 3", "cg whatever is configured", FM,
         "self.params.matching, self.params.temperature))", '"cg", self.params.temperature))', FM_TESTS),
    Swap("fedfm", "T_s: FedAvg before it, matching from round T_s", "Sec. VII-A",
         "the default 20 whatever is configured", FM, "return rnd >= self.params.start_round", "return rnd >= 20",
         FM_TESTS),
    Swap("fedfm", "the first matching round: T_s", "Sec. VII-A", "T_s + 1", FM,
         "return rnd >= self.params.start_round", "return rnd > self.params.start_round", FM_TESTS),
    Swap("fedfm", "the matched feature: L2-normalised", "Sec. VII-A", "the raw feature", FM,
         "h = F.normalize(out.features.float(), dim=1)", "h = out.features.float()", FM_TESTS),
    Swap("fedfm", "the anchors in the loss: L2-normalised", "Sec. VII-A", "the raw anchors", FM,
         "a = F.normalize(self.anchors.to(h.device, torch.float32), dim=1)",
         "a = self.anchors.to(h.device, torch.float32)", FM_TESTS),
    Swap("fedfm", "CG's softmax: over the defined anchors only", "Sec. IV-C",
         "over every row (undefined zero rows too)", FM,
         "s = torch.where(defined.unsqueeze(0), s, torch.full_like(s, -1e9))", "s = s", FM_TESTS),
    Swap("fedfm", "the samples matched: those whose class has an anchor", "Sec. IV-C", "every sample", FM,
         "valid = defined[y].to(h.dtype)", "valid = torch.ones_like(y, dtype=h.dtype)", FM_TESTS),
    Swap("fedfm", "l2: mean over the feature dimensions (the code's mse_loss)", "Eq. 3 (the code)",
         "the sum (Eq. 3 as printed)", FM, "per_sample = ((h - a[y_safe]) ** 2).mean(dim=1)",
         "per_sample = ((h - a[y_safe]) ** 2).sum(dim=1)", FM_TESTS),
    Swap("fedfm", "FedFM-Lite's anchors: of the locally trained model", "Sec. VI", "of the model it started from", FM,
         'arrays["anchors"] = self.anchor_upload(result.weights, client)',
         'arrays["anchors"] = self.anchor_upload(weights, client)', FM_TESTS),
    Swap("fedfm", "FedFM-Lite's a: models every a rounds counted from T_s", "Sec. VI", "counted from round 0", FM,
         "return rnd < self.params.start_round or (rnd - self.params.start_round) % self.params.model_every == 0",
         "return rnd < self.params.start_round or rnd % self.params.model_every == 0", FM_TESTS),
    Swap("fedfm", "FedFM-Lite's anchors: uploaded from round T_s - 1 on", "Sec. VI", "from round T_s on", FM,
         "anchors_up = ctx.round + 1 >= self.params.start_round", "anchors_up = ctx.round >= self.params.start_round",
         FM_TESTS),
]


def run_swap(swap: Swap, python: str, timeout: int) -> dict:
    path = ROOT / swap.file
    original = path.read_text()
    if original.count(swap.old) != 1:
        return {**asdict(swap), "result": "patch does not apply", "seconds": 0.0}
    t0 = time.monotonic()
    try:
        path.write_text(original.replace(swap.old, swap.new))
        # this checkout's src first, ahead of wherever the venv's editable install points
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        done = subprocess.run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-n", "0", *swap.tests.split()],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        result = "survived" if done.returncode == 0 else "killed"
        # the first failing test and its error, so a reader can tell an assertion from a crash of the patch
        failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "E   "))][:2]
    except subprocess.TimeoutExpired:
        result, failed = "killed (timeout)", []
    finally:
        path.write_text(original)
    return {**asdict(swap), "result": result, "by": failed, "seconds": round(time.monotonic() - t0, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", help="only this method's swaps")
    p.add_argument("--list", action="store_true", help="print the list and run nothing")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--python", help="the interpreter with fedhet's dependencies (default: .venv/bin/python here)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "wiring_mutants.json"))
    a = p.parse_args()
    swaps = [s for s in SWAPS if a.method in (None, s.method)]
    if a.list:
        print("| method | input | paper | wrong neighbour | tests |\n|---|---|---|---|---|")
        for s in swaps:
            print(f"| {s.method} | {s.input} | {s.where} | {s.wrong} | {s.tests} |")
        return 0
    python = a.python or str(ROOT / ".venv" / "bin" / "python")
    rows = []
    for s in swaps:
        row = run_swap(s, python, a.timeout)
        rows.append(row)
        print(f"{row['result']:>20}  {s.method}: {s.input} -> {s.wrong} ({row['seconds']} s)", flush=True)
    killed = sum(r["result"].startswith("killed") for r in rows)
    print(f"\n{killed} of {len(rows)} swaps killed")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    Path(a.out).write_text(json.dumps({"commit": commit, "killed": killed, "total": len(rows), "swaps": rows}, indent=1))
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
