"""Every method trains and evaluates on the run's device (``run.device``), with no work left on the CPU.

On a CPU machine the cross-device checks are skipped: there is no second device, and every other
test already runs the device code path with ``device="cpu"`` (the client host moves each job's
message and state with :func:`fedhet.core.contract.to_device`, which hands CPU tensors back as they
are). On a GPU machine (``FEDHET_TEST_DEVICE=cuda``, benchmarks/gpu_check.sh) each of the 30
methods runs two rounds through the real runner twice, ``run.device: cpu`` and ``run.device: cuda``,
on the reference and the vectorized engine, and the CUDA run must:

* never run a forward pass of the CPU models (the server's copies): training, the methods' own
  passes (prototypes, probability matrices, public-set predictions) and evaluation all use the
  device copies, whose parameters are on the device;
* report its device in the summary and, with the vectorized engine, count every request that did
  not run vmapped by reason (none silently);
* end where the CPU run ends, to a coarse tolerance: cuDNN and oneDNN sum in other orders, and
  ReLU kink flips grow such differences over two rounds of lr 0.05 (up to 2.7e-2 in relative L2
  distance on an H200: FedDecorr's server state; FedClassAvg's Adam clients and FedProto 2.1e-2
  and 2.4e-2), so the server state and each client's state (every floating tensor of each,
  together) must agree to 5e-2 and the headline accuracy to 5 points on the tiny synthetic test
  split. This catches a method computing on the wrong data or dropping a term, not rounding; the
  exact bound of the engines' float differences is tests/engine/test_engine_vectorized.py's.

With ``FEDHET_TEST_DETERMINISTIC=1`` every run has ``run.deterministic: true``: a method using an
operation that has no deterministic CUDA kernel then fails with torch's error naming the operation.
Set ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` too (gpu_check.sh does): torch reads it once per process, and
a worker that ran another CUDA test first would refuse the deterministic runs.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from fedhet.algorithms import ALGORITHMS
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import CHECKPOINT, Experiment

DEVICE = os.environ.get("FEDHET_TEST_DEVICE", "cpu")
cross_device = pytest.mark.skipif(DEVICE == "cpu", reason="needs FEDHET_TEST_DEVICE=cuda (a second device)")

MODEL_RTOL = 5e-2
ACC_ATOL = 0.05
# Methods none of whose requests the vectorized engine vmaps, and why (the run's fallback_reasons
# name it): FedNTD's teacher term is not declared pure, and Per-FedAvg's meta steps never reach
# client.train. (FedACD's mixup and FedClassAvg's views are vmapped; KT-pFL's private training is,
# its distillation is not.)
NOT_VMAPPED = {"fedntd", "perfedavg"}


def method_config(small_config: dict, name: str, engine: str, device: str) -> dict:
    """Two rounds of ``name`` on the small synthetic federation, with what the method needs."""
    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": name, "params": {}}
    raw["train"].update(rounds=2)
    raw["run"].update(engine=engine, device=device, checkpoint_every=100,
                      deterministic=os.environ.get("FEDHET_TEST_DETERMINISTIC") == "1")
    if name == "fedcme":         # its exchange needs two local epochs
        raw["train"].update(local_epochs=2)
    if name in ("fedfm", "fedfm_lite"):   # feature matching from the first round
        raw["algorithm"]["params"] = {"start_round": 0, "lam": 1.0}
    if name == "fednh":          # a bias-free linear head
        raw["model"] = {"arch": "simple_cnn"}
    if name == "ktpfl":          # heterogeneous models, a public set
        raw["model"] = {"arch": ["fca_cnn_a", "fca_cnn_b"]}
        raw["data"]["public"] = {"source": "holdout", "size": 100}
        raw["algorithm"]["params"] = {"public_size": 64, "distill_batch_size": 32}
    if name == "fedclassavg":    # heterogeneous models, Adam, two augmented views
        raw["model"] = {"arch": ["fca_cnn_a", "fca_cnn_b", "fca_cnn_c"]}
        raw["train"].update(optimizer="adam", betas=[0.5, 0.999], lr=1e-3, momentum=0.0)
    return raw


def run(raw: dict, tmp_path, tag: str):
    exp = Experiment.create(load_config(raw=raw), tmp_path / tag)
    cpu_calls = []
    hooks = [m.register_forward_pre_hook(lambda *a, arch=arch: cpu_calls.append(arch))
             for arch, m in exp.loop.host.models.items()] if DEVICE != "cpu" else []
    summary = exp.run(progress=False)
    for h in hooks:
        h.remove()
    return exp, summary, cpu_calls


def float_tensors(obj, path: str = "") -> dict[str, torch.Tensor]:
    """Every floating tensor in a nested state, by its path (server state, client states)."""
    if isinstance(obj, torch.Tensor):
        return {path: obj} if obj.is_floating_point() else {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out = {}
    for key, value in items:
        out.update(float_tensors(value, f"{path}/{key}"))
    return out


def states_of(exp) -> dict[str, dict[str, torch.Tensor]]:
    """What a run ends with: the server state and each client's state, as floating tensors."""
    out = {"server": float_tensors(exp.loop.server_state)}
    for cid, state in sorted(exp.loop.client_states.items()):
        out[f"client {cid}"] = float_tensors(state)
    return {k: v for k, v in out.items() if v}


def relative_distance(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    diff = torch.cat([(a[k].float() - b[k].float().cpu()).flatten() for k in a]).norm()
    return float(diff / torch.cat([a[k].float().flatten() for k in a]).norm().clamp(min=1e-12))


@cross_device
@pytest.mark.parametrize("engine", ["reference", "vectorized"])
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_a_run_on_the_device_leaves_no_work_on_the_cpu_and_matches_the_cpu_run(small_config, tmp_path, name,
                                                                                engine, monkeypatch):
    from fedhet.engine import vectorized

    monkeypatch.setattr(vectorized, "GRAPH_MIN_REPEATS", 2)    # short schedules replay graphs too
    cpu_exp, cpu_summary, _ = run(method_config(small_config, name, "reference", "cpu"), tmp_path, "cpu")
    dev_exp, dev_summary, cpu_calls = run(method_config(small_config, name, engine, DEVICE), tmp_path, "dev")
    assert dev_summary["status"] == "completed"
    assert dev_summary["device"] == DEVICE
    assert cpu_calls == [], f"{len(cpu_calls)} forward passes of the CPU models"
    host = dev_exp.loop.host
    for model in host.client_models.values():
        assert all(p.device.type == DEVICE for p in model.parameters())
    if engine == "vectorized":
        counters = dev_summary["engine"]
        assert sum(counters["fallback_reasons"].values()) == counters["fallback_requests"]
        assert not any(r.startswith("vmap error") for r in counters["fallback_reasons"]), counters["fallback_reasons"]
        assert (counters["vectorized_requests"] > 0) == (name not in NOT_VMAPPED), counters
        assert counters["eager_reasons"] == {}, counters["eager_reasons"]     # every CUDA graph captured
        if name == "fedavg":
            assert counters["graph_steps"] > 0
    metric = cpu_exp.metric
    assert dev_summary["headline"]["last"] == pytest.approx(cpu_summary["headline"]["last"], abs=ACC_ATOL), metric
    cpu_states, dev_states = states_of(cpu_exp), states_of(dev_exp)
    assert set(cpu_states) == set(dev_states)
    for key in cpu_states:
        assert relative_distance(cpu_states[key], dev_states[key]) <= MODEL_RTOL, key


def tensors_in(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return [t for value in items for t in tensors_in(value)]


@cross_device
# controls; personal heads; previous models; a personal head that evaluation adds to the global one
@pytest.mark.parametrize("name", ["scaffold", "fedper", "moon", "fedrod"])
def test_client_state_on_the_device_stays_there_and_checkpoints_on_the_cpu(small_config, tmp_path, name):
    """``run.client_state: device`` keeps each client's state on the device between rounds, its
    checkpoint holds the states on the CPU, and the run ends where the host-memory run ends (the
    same arithmetic; only cuDNN's nondeterministic backward may differ)."""
    raw = method_config(small_config, name, "vectorized", DEVICE)
    host_exp, host_summary, _ = run(raw, tmp_path, "host")
    raw["run"]["client_state"] = "device"
    dev_exp, dev_summary, _ = run(raw, tmp_path, "dev")
    assert dev_summary["status"] == "completed"
    host_tensors = tensors_in(host_exp.loop.client_states)
    dev_tensors = tensors_in(dev_exp.loop.client_states)
    assert dev_tensors and len(dev_tensors) == len(host_tensors)
    assert all(t.device.type == DEVICE for t in dev_tensors)
    assert all(t.device.type == "cpu" for t in host_tensors)
    # as written (load_checkpoint maps every tensor to the CPU, which would hide a CUDA tensor on disk)
    checkpoint = torch.load(dev_exp.run_dir / CHECKPOINT, weights_only=False)
    saved = tensors_in(checkpoint["sim"]["client_states"])
    assert saved and all(t.device.type == "cpu" for t in saved)
    host_states, dev_states = states_of(host_exp), states_of(dev_exp)
    assert set(host_states) == set(dev_states)
    for key in host_states:
        assert relative_distance(host_states[key], dev_states[key]) <= 1e-3, key
