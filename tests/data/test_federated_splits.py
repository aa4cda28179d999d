"""build_federation's splits for a seed are fixed: the same partitions and local test splits, bit for
bit, as the digests recorded from the code before its per-client loops were vectorized (local
test splits, their overlap removal, the client sizes the round loop hands out). Each case is
small; benchmarks/federation_scale.py measures the same code at 10,000 clients."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from fedhet.data.federated import build_federation
from fedhet.experiment.config import load_config

# (partition, data options) -> sha256 of every client's train and test indices, recorded from
# build_federation at commit 51213a8 on the synthetic data of tests/synthetic.py (seed 3).
CASES = {
    "iid_holdout": ({"kind": "iid"}, {"num_clients": 20, "local_test": {"source": "holdout", "fraction": 0.2}}),
    "iid_test_set_pool_fraction": ({"kind": "iid"}, {"num_clients": 20, "pool_fraction": 0.5}),
    "dirichlet_holdout": ({"kind": "dirichlet", "alpha": 0.5, "min_size": 5},
                          {"num_clients": 20, "local_test": {"source": "holdout", "fraction": 0.25}}),
    "dirichlet_test_set": ({"kind": "dirichlet", "alpha": 0.1, "min_size": 2}, {"num_clients": 20}),
    "shards_holdout": ({"kind": "shards"}, {"num_clients": 30, "local_test": {"source": "holdout", "fraction": 0.2}}),
    "shards_test_set": ({"kind": "shards"}, {"num_clients": 30, "local_test": {"source": "test_set", "fraction": 0.3}}),
    # with replacement: clients share images, so holdout drops test images another client trains on
    "classes_per_client_holdout": ({"kind": "classes_per_client", "k": 2, "samples_per_client": 40},
                                   {"num_clients": 10, "local_test": {"source": "holdout", "fraction": 0.3}}),
    "classes_per_client_test_set": ({"kind": "classes_per_client", "k": 3, "samples_per_client": 40},
                                    {"num_clients": 25}),
    # wraps around its label pools (samples reused across clients), pooled train+test
    "grouped_dominant_holdout": ({"kind": "grouped_dominant", "samples_per_client": 100, "s": 0.2},
                                 {"num_clients": 20, "pool": "train+test",
                                  "local_test": {"source": "holdout", "fraction": 0.2}}),
}

DIGESTS = {
    "iid_holdout": "c39f683905927a5deec483eba2fb179a40b2546be3f0d84aa363389db1603e3c",
    "iid_test_set_pool_fraction": "6fed020aa929217235aed23fcc808f0c8a68344c7cc6a1ae73e284ca9a4c3d7b",
    "dirichlet_holdout": "af28adce35c4b201be91f4a44577945f02b55b28b41f3ff2ddfaa6af6f6e0a17",
    "dirichlet_test_set": "5aeb112b63a71294cdfcf0aabc320f07f3c04b95ba14e7c9c46961811b4a7f90",
    "shards_holdout": "a68acfdd2ad5106bcc3a7bcffda8b6a70aa3b4b69a0170ee5e5f95be019fcd39",
    "shards_test_set": "38cbeeade55d9d4e1f9f8c89e9caefc25e139d45699b3ec55370061c58fe4cc1",
    "classes_per_client_holdout": "c3970e0c44895515af946d9802dce0caae3508ff2908f716394ed58e4de3d82e",
    "classes_per_client_test_set": "9c487e84e974ac1a7f3bd9c78eda53f93781116e48fa9b64f49b4894ad3e2696",
    "grouped_dominant_holdout": "52f460d52cdecd629728ee68ece5a4a615eac5f86da4862ac810a51a265178e0",
}


def federation(root, partition: dict, data: dict):
    raw = {"seed": 3, "data": {"root": str(root), "verify": False, "partition": partition,
                               "local_test": {"source": "test_set", "fraction": 0.2}, **data}}
    return build_federation(load_config(raw=raw).data, 3)


def digest(fed) -> str:
    h = hashlib.sha256()
    for which in (fed.train_idx, fed.test_idx):
        for t in which:
            arr = t.numpy()
            assert arr.dtype == np.int64
            h.update(len(arr).to_bytes(8, "little"))
            h.update(arr.tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_splits_of_a_seed_are_the_recorded_ones(synth_root, case):
    fed = federation(synth_root, *CASES[case])
    assert digest(fed) == DIGESTS[case]


@pytest.mark.parametrize("case", ["classes_per_client_holdout", "grouped_dominant_holdout", "iid_holdout"])
def test_no_local_test_image_is_trained_on_by_any_client(synth_root, case):
    fed = federation(synth_root, *CASES[case])
    trained = set(np.concatenate([t.numpy() for t in fed.train_idx]).tolist())
    assert all(not (set(t.numpy().tolist()) & trained) for t in fed.test_idx)
    assert all(len(t) for t in fed.test_idx)


def test_client_sizes_are_the_training_split_sizes_in_a_new_dict_each_call(synth_root):
    fed = federation(synth_root, *CASES["dirichlet_test_set"])
    sizes = fed.client_sizes()
    assert sizes == {c: len(t) for c, t in enumerate(fed.train_idx)}
    sizes[0] = -1                       # a caller's change does not reach the next caller
    assert fed.client_sizes()[0] == len(fed.train_idx[0])


def test_like_sampler_draws_what_sample_like_draws_client_after_client():
    from fedhet.core.errors import PartitionError
    from fedhet.data.local_test import LikeSampler, sample_like

    pool = np.random.default_rng(1).integers(0, 10, 3000)
    exclude = np.arange(0, 3000, 7)
    clients = [np.random.default_rng(s).integers(0, 10, 1 + s * 13) % (s % 9 + 2) for s in range(40)]
    for excluded in (None, exclude):
        a, b = np.random.default_rng(5), np.random.default_rng(5)
        sampler = LikeSampler(pool, 10, exclude=excluded)
        for i, labels in enumerate(clients):
            size = (7 * i) % 60
            expected = sample_like(labels, pool, size, 10, a, exclude=excluded)
            got = sampler(labels, size, b)
            assert got.dtype == expected.dtype == np.int64 and np.array_equal(got, expected)
    for call in (lambda: sample_like(np.array([0]), pool, 400, 10, np.random.default_rng(0)),
                 lambda: LikeSampler(pool, 10)(np.array([0]), 400, np.random.default_rng(0)),
                 lambda: LikeSampler(pool, 5)(np.array([0]), 4, np.random.default_rng(0))):
        with pytest.raises(PartitionError, match="^sample_like: "):
            call()


def test_local_tests_shrunk_to_a_few_images_by_shared_training_images_are_warned_of(small_config, tmp_path,
                                                                                    monkeypatch):
    """Clients whose data overlap by half: most of each client's held-out images are others' training
    images, so they leave its local test; the warning says how many are left, and plain splits
    say nothing."""
    import warnings

    from helpers import module_of_ones_own

    module_of_ones_own(tmp_path, monkeypatch, "lab_overlap",
                       "import numpy as np\n\n\ndef halves(labels, num_clients, rng):\n    n = len(labels)\n"
                       "    return [np.sort((np.arange(n // 2) + c * n // num_clients) % n) for c in range(num_clients)]\n")
    raw = {**small_config, "data": {**small_config["data"], "partition": {"kind": "lab_overlap:halves"},
                                    "local_test": {"source": "holdout", "fraction": 0.2}}}
    cfg = load_config(raw=raw)
    with pytest.warns(UserWarning, match=r"data.local_test \(holdout, fraction 0.2\): \d+ of the \d+ images held out "
                                         r"for the clients' local tests are images other clients train on") as said:
        fed = build_federation(cfg.data, cfg.seed)
    kept = sum(len(te) for te in fed.test_idx)
    assert f"the local tests hold {kept} images" in str(said[0].message)
    plain = load_config(raw={**raw, "data": {**raw["data"], "partition": {"kind": "iid"}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_federation(plain.data, plain.seed)
