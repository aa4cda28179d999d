"""FedLC (Zhang et al., ICML 2022, "Federated Learning with Label Distribution Skew via Logits Calibration").

Each client calibrates its logits by its own label counts before the cross-entropy, so classes it
has many samples of are pushed less and rare or missing classes are not suppressed (paper Sec. 4,
Eq. 7; reference: KarhouTam/FL-bench ``src/client/fedlc.py``):

    loss = CE(f(x) - tau * n^(-1/4), y),   n_c = the client's count of class c (1e-8 when absent)

so an absent class's logit is lowered by ``tau * 100`` during local training. The paper prints the
softmax's denominator as a sum over the classes other than y; with it training collapses (as
FL-bench's author reported trying it), so the true class stays in the sum here, as in FL-bench. The server is FedAvg's;
the global model is evaluated with plain logits. ``tau`` = 1.0 is FL-bench's default.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import ClientRuntime, Message, State
from fedhet.training.objective import LossTerm
from fedhet.training.terms import OffsetCrossEntropy


def calibration(counts: torch.Tensor, tau: float, absent: float = 1e-8) -> torch.Tensor:
    """``tau * n_c^(-1/4)`` per class, with ``n_c = absent`` for classes the client lacks (subtracted
    from the logits)."""
    n = torch.where(counts > 0, counts.double(), torch.full_like(counts, absent, dtype=torch.float64))
    return (tau * n.pow(-0.25)).float()


class FedLC(FedAvg):
    name = "fedlc"
    reads_no_global_model = True      # its term needs the client's own data and model only

    class Params(FedAvg.Params):
        calibration_tau: float = Field(1.0, ge=0)

    def data_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        counts = client.data.label_counts(client.num_classes)
        return [OffsetCrossEntropy(-calibration(counts, self.params.calibration_tau), name="calibrated_ce")]
