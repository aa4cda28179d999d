"""What is measured each evaluation round, named so nobody has to guess which model on which data.

* ``global_acc`` - the global model on the balanced global test set (generic FL methods);
  ``global_per_class`` - its accuracy per class.
* ``global_labeldist_acc`` - the same model's per-class results re-weighted by each client's
  training label distribution, mean over clients (FedACD Table 2; FedNH's ``labeldist`` metric):
  acc_k = sum_c pi_kc correct_c / sum_c pi_kc count_c. A client none of whose classes the test
  set holds (a test set of held-out writers, or data of one's own) has no acc_k and is left out of
  the mean; ``global_labeldist_clients`` says how many clients it averages when some are.
* ``personal_acc`` / ``personal_acc_std`` - each client's own evaluation model
  (``Algorithm.client_model``) on its own local test split; mean and std over clients.
  ``personal_acc_pooled`` is sum(correct)/sum(samples) over all clients (FedReMa's metric).
  ``eval.clients`` may restrict them to the round's sampled clients or a fixed random subset
  (:func:`evaluation_clients`); ``personal_clients`` records how many were tested, and
  ``personal_acc_by_client`` maps each of them (its id) to its accuracy (a JSON object in
  ``metrics.jsonl``, keys as strings; runs recorded before it hold a list over all clients, None
  for those not tested).
* ``personal_loss`` - each client's mean cross-entropy on its own local test split (the same
  passes), mean over clients: FedClassAvg's selection rule (the round of minimum mean local test
  loss, the authors' ``best_val_loss``); ``personal_loss_by_client`` as for the accuracy.
* ``global_val_acc`` - with held-out local splits (``data.local_test.source: holdout``), the
  global model on the union of the clients' held-out splits (sum of correct over sum of
  samples): the validation accuracy of the FedFM paper's model selection (Ye et al.,
  Sec. VII-A: the test accuracy is reported at the round of the best validation accuracy).
* ``local_risk`` (with ``eval.local_risk``) - the round's *local* models (what each participant
  uploaded) judged over every client's label distribution: ``R(w_m) = (1/M) sum_n eps(w_m) . pi^n``
  with ``eps_c`` the per-class error on the balanced test set and ``pi^n`` client n's training
  label distribution (FedACD paper, Zhou et al., Eq. 3), mean over the participants m (FedACD Table 3; lower is
  better). ``local_kl`` - mean over them of ``KL(P^m || Q)`` of the local model on its own
  training split (FedACD Table 9, template tau = 1 - 1e-5, mean over the client's present rows).
  The tau is fixed, not a FedACD run's ``template_tau``: Table 9 compares methods, and a run
  without FedACD has no tau of its own, so every method is measured against the same Q.
  The model judged is the one the upload stands for (``FedAvg.local_model``: FedBABU's shared
  part with its frozen initial head); a method whose clients upload part of their model (FedPer's
  body) is refused at set-up (experiment.build.check_local_risk); one that uploads none in a round
  has no local_risk there.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch
from torch.func import functional_call

from fedhet.algorithms.base import Algorithm
from fedhet.algorithms.fedacd import local_probability_matrix, template_kl
from fedhet.core.contract import Arrays, ClientData, State, to_device
from fedhet.core.seeding import numpy_rng
from fedhet.data.federated import Federation
from fedhet.engine.loop import RoundLoop
from fedhet.training.inference import channels_last, pass_rows
from fedhet.training.local import model_entries
from fedhet.training.mode import in_mode


@torch.inference_mode()       # lighter than no_grad: no autograd bookkeeping at all
def predict(model: torch.nn.Module, weights, x_uint8: torch.Tensor, y: torch.Tensor, normalize, batch_size: int,
            precision: str = "fp32", device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample correctness (bool) and cross-entropy (float32) of ``weights`` on (x, y), both on
    the CPU, in no-grad passes; ``precision`` "bf16" runs the forward under bf16 autocast
    (as training does, the loss on fp32 logits), "fp32" without (``eval.precision``). Sums over
    samples or clients are the callers' (in double).

    On the CPU, images and convolution weights go in channels_last: oneDNN's convolutions and
    max-pooling run faster in that layout (logits differ from the default layout's by
    float rounding, ~1e-7; evaluation is never fed back into training), and a pass takes a few
    dozen rows per thread (:func:`fedhet.training.inference.pass_rows`). On another ``device``
    (``model`` must live there) the weights and each pass's uint8 images are copied there and
    normalised there, ``batch_size`` rows a pass, and the results come back once at the end,
    not once per pass."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"evaluation precision must be 'fp32' or 'bf16', got {precision!r}")
    device = torch.device(device)
    rows = pass_rows(batch_size, device)
    weights = model_entries(model, weights)
    if device.type == "cpu":
        weights = {k: channels_last(v) for k, v in weights.items()}
    else:
        weights = to_device(weights, device)
    hits, losses = [], []
    with in_mode(model, training=False):
        for i in range(0, len(y), rows):
            xb = x_uint8[i:i + rows].to(device)
            x = channels_last(normalize(xb)) if device.type == "cpu" else normalize(xb)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                logits = functional_call(model, weights, (x,), strict=False)
            logits = logits.float()
            yb = y[i:i + rows].to(device)
            losses.append(torch.nn.functional.cross_entropy(logits, yb, reduction="none"))
            hits.append(logits.argmax(1) == yb)
    if not hits:
        return torch.zeros(0, dtype=torch.bool), torch.zeros(0)
    return torch.cat(hits).cpu(), torch.cat(losses).cpu()


def labeldist_accuracy(train_counts: np.ndarray, correct: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Per-client accuracy of one model re-weighted by each client's label distribution pi_k:
    acc_k = sum_c pi_kc correct_c / sum_c pi_kc total_c (FedNH ``labeldist``; FedACD Table 2);
    NaN for a client none of whose classes has a test image."""
    pi = train_counts / train_counts.sum(1, keepdims=True)
    weight = pi @ total
    return np.divide(pi @ correct, weight, out=np.full(len(weight), np.nan), where=weight > 0)


# Clients whose evaluation models are held at once (``evaluate``): the memory of personalized
# evaluation stays that of this many models, however many clients are evaluated.
EVAL_CLIENTS_PER_CHUNK = 64


def evaluation_clients(which: str | int, num_clients: int, sampled: list[int], seed: int) -> list[int]:
    """The clients whose local test splits are evaluated (``eval.clients``): all of them, the
    round's ``sampled`` ones, or a fixed subset of ``which`` clients drawn once from the run seed."""
    if which == "all":
        return list(range(num_clients))
    if which == "sampled":
        return sorted(sampled)
    if isinstance(which, int) and which >= 1:
        if which >= num_clients:
            return list(range(num_clients))
        return sorted(int(c) for c in numpy_rng(seed, "eval-clients").choice(num_clients, which, replace=False))
    raise ValueError(f"eval.clients must be 'all', 'sampled' or a positive number of clients, got {which!r}")


def evaluate(algorithm: Algorithm, server_state: State, client_model: Callable[[int], Arrays],
             models: dict[str, torch.nn.Module], client_arch: list[str], fed: Federation,
             batch_size: int = 2048, personalized: bool = True, clients: list[int] | None = None,
             precision: str = "fp32", device: str | torch.device = "cpu") -> dict:
    """This round's metrics (module docstring). ``client_model(cid)`` gives the weights client
    ``cid`` is evaluated with (``RoundLoop.client_model``); ``clients`` limits the personalized
    metrics to those clients (default: all); ``precision`` and ``device`` are those of every
    forward pass (:func:`predict`; ``models`` live on ``device``)."""
    evaluated = list(range(fed.num_clients)) if clients is None else list(clients)
    out: dict = {}

    global_weights = algorithm.global_model(server_state)
    # The global and validation passes keep per-sample losses, for the clients the personalized
    # metrics test with the global model; global_loss is their sum whether or not those are computed
    # (the same number in a Flower run, whose server evaluates without personalized metrics).
    global_hits = global_losses = None
    if global_weights is not None and fed.test is not None:
        arch = client_arch[0]
        global_hits, global_losses = predict(models[arch], global_weights, fed.test.x, fed.test.y, fed.normalize,
                                             batch_size, precision, device)
        correct = torch.bincount(fed.test.y[global_hits], minlength=fed.num_classes).numpy()
        total = torch.bincount(fed.test.y, minlength=fed.num_classes).numpy()
        out["global_acc"] = float(correct.sum() / total.sum())
        out["global_loss"] = float(global_losses.double().sum()) / float(total.sum())
        out["global_per_class"] = [float(c / t) if t else None for c, t in zip(correct, total)]
        per_client = labeldist_accuracy(fed.train_counts(), correct, total)
        judged = per_client[~np.isnan(per_client)]
        if len(judged):
            out["global_labeldist_acc"] = float(judged.mean())
        if len(judged) < len(per_client):
            out["global_labeldist_clients"] = len(judged)

    val_hits = val_losses = None
    if global_weights is not None and fed.local_test_source == "holdout":
        xs, ys = zip(*(fed.local_test(cid) for cid in range(fed.num_clients)))
        x, y = torch.cat(xs), torch.cat(ys)
        val_hits, val_losses = predict(models[client_arch[0]], global_weights, x, y, fed.normalize, batch_size,
                                       precision, device)
        out["global_val_acc"] = float(val_hits.float().mean())
        val_offsets = np.cumsum([0] + [len(t) for t in ys])

    if personalized:
        correct_k = np.zeros(fed.num_clients)
        count_k = np.zeros(fed.num_clients)
        loss_k = np.zeros(fed.num_clients)          # summed cross-entropy (the tensors are on the CPU)

        def test(weights: Arrays, cids: list[int]) -> None:
            """Clients ``cids``, all evaluated with ``weights`` (one architecture), into the sums."""
            if (weights is global_weights and global_hits is not None and global_losses is not None
                    and fed.local_test_source == "test_set"):
                for cid in cids:                      # the global pass above tested their splits
                    correct_k[cid] = float(global_hits[fed.test_idx[cid]].sum())
                    loss_k[cid] = float(global_losses[fed.test_idx[cid]].double().sum())
                    count_k[cid] = len(fed.test_idx[cid])
                return
            if weights is global_weights and val_hits is not None and val_losses is not None:
                for cid in cids:                      # the validation pass above tested exactly these
                    correct_k[cid] = float(val_hits[val_offsets[cid]:val_offsets[cid + 1]].sum())
                    loss_k[cid] = float(val_losses[val_offsets[cid]:val_offsets[cid + 1]].double().sum())
                    count_k[cid] = val_offsets[cid + 1] - val_offsets[cid]
                return
            xs, ys, owner = [], [], []
            for i, cid in enumerate(cids):
                x, y = fed.local_test(cid)
                xs.append(x)
                ys.append(y)
                owner.append(torch.full((len(y),), i, dtype=torch.long))
            x, y, who = torch.cat(xs), torch.cat(ys), torch.cat(owner)     # who: a sample's place in cids
            hits, losses = predict(models[client_arch[cids[0]]], weights, x, y, fed.normalize, batch_size,
                                   precision, device)
            # counted over this group's clients, not all K: one client a group (each its own model)
            # would otherwise cost O(K) a group and O(K^2) an evaluation
            at = np.asarray(cids)
            correct_k[at] += torch.bincount(who[hits], minlength=len(cids)).numpy()
            loss_k[at] += torch.bincount(who, weights=losses.double(), minlength=len(cids)).numpy()
            count_k[at] += torch.bincount(who, minlength=len(cids)).numpy()

        # Clients evaluated with the same weights object are tested in one batched pass; those
        # evaluated with the global model reuse the global pass. A chunk of clients' weights at a
        # time: a client's model may come from a state the store spilled to disk, and holding every
        # client's at once would grow with the clients evaluated. (A weights object other than the
        # global model's shared by clients of several chunks is tested in one pass a chunk, whose
        # losses may differ from one pass's in the last bits; no built-in method shares one.)
        on_global: dict[str, list[int]] = defaultdict(list)
        for start in range(0, len(evaluated), EVAL_CLIENTS_PER_CHUNK):
            groups: dict[tuple[int, str], list[int]] = defaultdict(list)
            weights_of: dict[tuple[int, str], Arrays] = {}
            for cid in evaluated[start:start + EVAL_CLIENTS_PER_CHUNK]:
                w = client_model(cid)
                if w is global_weights:
                    on_global[client_arch[cid]].append(cid)
                    continue
                key = (id(w), client_arch[cid])       # ids are unique while weights_of holds them
                groups[key].append(cid)
                weights_of[key] = w
            for key, cids in groups.items():
                test(weights_of[key], cids)
            del groups, weights_of
        for cids in on_global.values():
            test(global_weights, cids)
        out.update(personal_metrics(correct_k, count_k, loss_k, evaluated))
    return out


def personal_metrics(correct: np.ndarray, count: np.ndarray, loss: np.ndarray | None, clients: list[int]) -> dict:
    """The ``personal_*`` metrics (module docstring) from per-client correct counts, sample counts
    and summed cross-entropies (arrays over all clients; only ``clients`` are read; ``loss`` None
    leaves the loss metrics out): the simulator's and the Flower server's one formula."""
    def by_client(num: np.ndarray) -> dict[int, float]:
        # the evaluated clients only: a row's size follows them, not the federation's
        return {c: round(float(num[c] / count[c]), 5) for c in sorted(clients)}

    acc = correct[clients] / count[clients]
    out = {"personal_acc": float(acc.mean()), "personal_acc_std": float(acc.std()),
           "personal_acc_pooled": float(correct[clients].sum() / count[clients].sum()),
           "personal_acc_by_client": by_client(correct)}
    if loss is not None:
        out["personal_loss"] = float((loss[clients] / count[clients]).mean())
        out["personal_loss_by_client"] = by_client(loss)
    out["personal_clients"] = len(clients)
    return out


def local_model_risk(models: dict[str, torch.nn.Module], client_arch: list[str], local_models: dict[int, Arrays],
                     fed: Federation, batch_size: int = 2048, precision: str = "fp32",
                     device: str | torch.device = "cpu", client_data: Callable[[int], ClientData] | None = None) -> dict:
    """``local_risk`` and ``local_kl`` of the uploaded local models (module docstring); the risk's
    test-set passes in ``precision``, the KL's probability matrix in fp32 (FedACD's own statistic),
    both on ``device`` (``models`` and ``client_data(cid)``, default the federation's, live there),
    on the CPU both in evaluation's passes (:func:`predict`)."""
    if not local_models or fed.test is None:
        return {}
    data_of = client_data or fed.client_data
    counts = fed.train_counts().astype(np.float64)
    pi_mean = (counts / counts.sum(1, keepdims=True)).mean(0)      # (1/M) sum_n pi^n
    total = torch.bincount(fed.test.y, minlength=fed.num_classes).numpy()
    risk, kl = {}, {}
    for cid in sorted(local_models):
        model = models[client_arch[cid]]
        hits, _ = predict(model, local_models[cid], fed.test.x, fed.test.y, fed.normalize, batch_size, precision,
                          device)
        correct = torch.bincount(fed.test.y[hits], minlength=fed.num_classes).numpy()
        error = 1.0 - correct / np.maximum(total, 1)
        risk[cid] = float(error @ pi_mean)
        P, class_counts = local_probability_matrix(model, to_device(local_models[cid], device), data_of(cid),
                                                   fed.num_classes, fast_passes=True)
        kl[cid] = template_kl(P.cpu(), class_counts.cpu() > 0)
    return {"local_risk": float(np.mean(list(risk.values()))), "local_kl": float(np.mean(list(kl.values()))),
            "local_risk_by_client": risk, "local_kl_by_client": kl}


def evaluate_loop(loop: RoundLoop, batch_size: int = 2048, personalized: bool = True,
                  local_models: dict[int, Arrays] | None = None, clients: list[int] | None = None,
                  precision: str = "fp32") -> dict:
    """:func:`evaluate` of a round loop's current state (and :func:`local_model_risk` of the local
    models given: those the round's clients uploaded, which the runner keeps under eval.local_risk),
    on the device its clients run on."""
    host = loop.host
    out = evaluate(loop.algorithm, loop.server_state, loop.client_model, host.client_models, host.client_arch,
                   host.federation, batch_size, personalized, clients, precision, host.device)
    if local_models:
        out.update(local_model_risk(host.client_models, host.client_arch, local_models, host.federation,
                                    batch_size, precision, host.device, host.client_data))
    return out
