"""data.public: the unlabelled public set of knowledge-transfer methods (KT-pFL), disjoint from every
client's training and local-test images."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from fedhet.core.errors import ConfigError, PartitionError
from fedhet.data.federated import build_federation, stratified_draw
from fedhet.experiment.config import load_config


def _data_cfg(root, **data):
    raw = {"data": {"root": str(root), "verify": False, "num_clients": 4,
                    "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5},
                    "local_test": {"source": "holdout", "fraction": 0.2}, **data},
           "train": {"clients_per_round": 4}}
    return load_config(raw=raw).data


def _rows(images: torch.Tensor) -> set[bytes]:
    return {bytes(r) for r in images.reshape(images.shape[0], -1).numpy()}


def _client_rows(fed) -> set[bytes]:
    rows: set[bytes] = set()
    for cid in range(fed.num_clients):
        rows |= _rows(fed.pool.x[fed.train_idx[cid]])
        rows |= _rows(fed.local_test(cid)[0])
    return rows


def test_stratified_draw_keeps_proportions_without_replacement():
    labels = np.concatenate([np.full(600, 0), np.full(300, 1), np.full(100, 2)])
    among = np.arange(0, 1000, 2)                     # 300 zeros, 150 ones, 50 twos
    drawn = stratified_draw(labels, among, 100, np.random.default_rng(0), "holdout")
    assert len(np.unique(drawn)) == 100 and np.isin(drawn, among).all()
    assert np.bincount(labels[drawn]).tolist() == [60, 30, 10]
    assert np.array_equal(drawn, stratified_draw(labels, among, 100, np.random.default_rng(0), "holdout"))
    # 7 slots over proportions 0.6/0.3/0.1 -> 4.2/2.1/0.7: floors 4/2/0, the leftover to the largest remainder
    assert np.bincount(labels[stratified_draw(labels, among, 7, np.random.default_rng(1), "x")],
                       minlength=3).tolist() == [4, 2, 1]
    with pytest.raises(PartitionError, match="pool_fraction"):
        stratified_draw(labels, among, 501, np.random.default_rng(0), "unsampled")


def test_unsampled_public_set_leaves_the_partition_unchanged_and_is_disjoint(synth_root):
    plain = build_federation(_data_cfg(synth_root, pool_fraction=0.5), seed=3)
    fed = build_federation(_data_cfg(synth_root, pool_fraction=0.5,
                                     public={"source": "unsampled", "size": 200}), seed=3)
    assert plain.public is None and fed.public is not None
    assert fed.public.shape == (200, 1, 28, 28) and fed.public.dtype == torch.uint8
    for a, b in zip(plain.train_idx + plain.test_idx, fed.train_idx + fed.test_idx):
        assert torch.equal(a, b)
    assert not _rows(fed.public) & _client_rows(fed)
    assert torch.equal(fed.client_data(1).public, fed.public)
    with pytest.raises(PartitionError, match="pool_fraction"):
        build_federation(_data_cfg(synth_root, public={"source": "unsampled", "size": 10}), seed=3)


def test_holdout_public_set_is_carved_out_before_the_partition(synth_root):
    fed = build_federation(_data_cfg(synth_root, public={"source": "holdout", "size": 300}), seed=3)
    assert fed.public.shape[0] == 300
    assert not _rows(fed.public) & _client_rows(fed)
    used = sum(len(t) for t in fed.train_idx) + sum(len(t) for t in fed.test_idx)
    assert used == fed.pool.x.shape[0] - 300         # dirichlet + holdout use every remaining image once
    labels_of = {bytes(r): int(y) for r, y in zip(fed.pool.x.reshape(len(fed.pool.y), -1).numpy(), fed.pool.y)}
    public_labels = np.array([labels_of[r] for r in (bytes(x) for x in fed.public.reshape(300, -1).numpy())])
    assert np.bincount(public_labels, minlength=10).tolist() == [30] * 10     # the synthetic pool is balanced


def test_public_set_from_another_dataset(synth_root, tmp_path, data_root):
    root = tmp_path / "root"
    shutil.copytree(synth_root / "fashion_mnist", root / "fashion_mnist")
    shutil.copytree(synth_root / "fashion_mnist", root / "mnist")       # any IDX files of MNIST's names
    fed = build_federation(_data_cfg(root, public={"source": "dataset", "dataset": "mnist", "size": 50,
                                                   "classes": [3, 7]}), seed=0)
    mnist_rows = {bytes(r): int(y) for r, y in zip(fed.pool.x.reshape(len(fed.pool.y), -1).numpy(), fed.pool.y)}
    assert fed.public.shape[0] == 50
    assert {mnist_rows[r] for r in _rows(fed.public)} <= {3, 7}
    plain = build_federation(_data_cfg(root), seed=0)
    for a, b in zip(plain.train_idx, fed.train_idx):
        assert torch.equal(a, b)
    with pytest.raises(PartitionError, match="only 240 such images"):
        build_federation(_data_cfg(root, public={"source": "dataset", "dataset": "mnist", "size": 241,
                                                 "classes": [3, 7]}), seed=0)
    with pytest.raises(PartitionError, match="not classes of mnist"):
        build_federation(_data_cfg(root, public={"source": "dataset", "dataset": "mnist", "classes": [10]}), seed=0)
    with pytest.raises(PartitionError, match="the private dataset fashion_mnist, whose train split the clients hold"):
        build_federation(_data_cfg(root, public={"source": "dataset", "dataset": "fashion_mnist", "size": 5}), seed=0)
    shutil.copytree(data_root / "cifar-10-batches-py", root / "cifar10" / "cifar-10-batches-py")
    with pytest.raises(PartitionError, match="same shape"):
        build_federation(_data_cfg(root, public={"source": "dataset", "dataset": "cifar10", "size": 5}), seed=0)


def test_public_config_errors():
    with pytest.raises(ConfigError, match="needs data.public.dataset"):
        load_config(raw={"data": {"public": {"source": "dataset"}}, "train": {"clients_per_round": 4}})
    with pytest.raises(ConfigError, match=r"only apply with data.public.source: dataset; with source 'holdout' leave "
                                          r"them out \(--set data.public.dataset=null over a config that sets it\)"):
        load_config(raw={"data": {"public": {"source": "holdout", "dataset": "mnist"}}})
    with pytest.raises(ConfigError, match="size"):
        load_config(raw={"data": {"public": {"size": 0}}})
