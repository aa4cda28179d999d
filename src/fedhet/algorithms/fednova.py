"""FedNova (Wang, Liu, Liang, Joshi & Poor, NeurIPS 2020): normalized averaging of local updates.

Clients that run more local steps move further; plain averaging then biases the global model
towards their objectives. FedNova divides each client's update by the norm of its local
gradient-coefficient vector and rescales the average by an effective step count (paper eq. 6,
and the momentum case of its Section 5; reference code: NIID-Bench ``train_net_fednova`` and the
FedNova branch of its ``experiments.py``):

  client i:  tau_i = local SGD steps,  a_i = (tau_i - rho (1 - rho^tau_i) / (1 - rho)) / (1 - rho)
             for SGD momentum rho (a_i = tau_i when rho = 0),  d_i = (w_global - w_i) / a_i
  server:    p_i = n_i / sum_j n_j,  tau_eff = sum_i p_i a_i,  w <- w - tau_eff * sum_i p_i d_i

The client computes a_i (as in the reference) from the step size and momentum it actually
trained with (``local_step``: the run's, or Per-FedAvg's plain meta-steps at beta) and, combined
with FedProx or FedDyn, from their proximal terms too (``proximal_pull``; paper Sec. 4: a_i =
(1 - (1 - lr mu)^tau) / (lr mu) without momentum; ``fedhet.training.steps.normalizing_factor``). It
reports a_i in the reply scalars next to ``steps``; the uploaded payload is the trained model as
in FedAvg (the server forms d_i itself), so communication equals FedAvg's. Floating-point
tensors, BatchNorm statistics included, follow the normalized rule as in the reference;
non-float buffers (``num_batches_tracked``) are averaged by sample count.
"""

from __future__ import annotations

import torch

from fedhet.algorithms.aggregate import weighted_average
from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import Arrays, ClientRuntime, Message, Replies, State
from fedhet.training.steps import normalizing_factor


class FedNova(FedAvg):
    name = "fednova"
    reads_one_messages_training = True  # a_i from that training's steps
    requires_sgd = True

    class Params(FedAvg.Params):
        pass

    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        if msg.kind != "train":                     # another component's phase (FedFM's anchors)
            return super().client_update(msg, state, client)
        reply, state = super().client_update(msg, state, client)
        lr, momentum = self.local_step(client)
        # a composed proximal term (fedprox+fednova, feddyn+fednova) pulls every local step back
        # towards the start, which shortens a_i (FedNova Sec. 4)
        reply.scalars["a_i"] = normalizing_factor(int(reply.scalars["steps"]), momentum, lr * self.proximal_pull())
        return reply, state

    def average_models(self, model: Arrays | None, replies: Replies, cids: list[int]) -> Arrays:
        """The normalised average in place of FedAvg's mean; in a composition the other components'
        server rules (FedAvgM, FedDyn, SCAFFOLD's server_lr) go on from it, in either order."""
        if model is None:
            raise ValueError("FedNova normalises each update against the round's global model, and the server "
                             "state holds no 'model'")
        models = [replies[c].arrays["model"] for c in cids]
        n = self.aggregation_weights(replies, cids)
        a = [float(replies[c].scalars["a_i"]) for c in cids]
        p = [x / sum(n) for x in n]
        tau_eff = sum(pi * ai for pi, ai in zip(p, a))
        new = {}
        for name, w in model.items():
            if not w.is_floating_point() or name not in models[0]:
                new[name] = w            # integers: averaged below; not uploaded (fedbabu+fednova: the head): kept
                continue
            direction = torch.zeros_like(w)
            for pi, ai, m in zip(p, a, models):
                if ai > 0:  # a client that took no step has w_i == w and d_i = 0
                    direction += (pi / ai) * (w - m[name])
            new[name] = w - tau_eff * direction
        ints = [k for k, w in model.items() if not w.is_floating_point() and k in models[0]]
        if ints:
            new.update(weighted_average(models, n, keys=ints))
        return {k: new[k] for k in model}
