"""Feature-space quality of a model (FedFM paper (Ye et al.), Sec. VII-B, Table V and Fig. 6).

* ``feature_nmi`` - k-means (k = number of classes) on the features of a sample of the global
  test set, then the normalized mutual information between the clusters and the true classes;
* ``feature_silhouette`` - the silhouette score of the same features with the true classes as
  the clusters (how much closer a sample is to its own class than to the nearest other class);
* a t-SNE embedding of the features for a scatter plot coloured by class (Fig. 6).

The paper computes both numbers with scikit-learn and so does fedhet (the optional extra
``pip install 'fedhet[features]'``); features are the model's body output (the head's input),
unnormalised. The sample is a fixed, seeded subset of the test set, so numbers of different
runs are computed on the same images.
"""

from __future__ import annotations

import numpy as np
import torch

from fedhet.core.contract import Arrays, to_device
from fedhet.core.errors import ConfigError
from fedhet.data.federated import Federation
from fedhet.training.local import forward
from fedhet.training.mode import in_mode


def _sklearn():
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise ConfigError("feature-space metrics need scikit-learn: pip install 'fedhet[features]' "
                          "(or pip install scikit-learn)") from None


def sample_positions(num: int, size: int, seed: int = 0) -> np.ndarray:
    """Sorted positions of a seeded random subset of ``size`` of ``num`` items (all if fewer)."""
    if size >= num:
        return np.arange(num)
    return np.sort(np.random.default_rng(seed).choice(num, size=size, replace=False))


@torch.no_grad()
def global_test_features(model: torch.nn.Module, weights: Arrays, fed: Federation, samples: int = 2000,
                  seed: int = 0, batch_size: int = 1000,
                  device: str | torch.device = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """``(features (n, d), labels (n,))`` of ``weights`` (eval mode) on a seeded sample of the
    global test set; the forward pass on ``device`` (where ``model`` lives)."""
    if fed.test is None:
        raise ConfigError("feature-space metrics use the global test set, and this run has none (data.pool: "
                          "train+test puts the test split into the clients' data): they need a run made with "
                          "data.pool: train")
    pos = torch.as_tensor(sample_positions(len(fed.test.y), samples, seed))
    feats = []
    weights = to_device(weights, device)
    with in_mode(model, training=False), torch.no_grad():
        for i in range(0, len(pos), batch_size):
            x = fed.normalize(fed.test.x[pos[i:i + batch_size]].to(device))
            feats.append(forward(model, weights, x).features.float())
    return torch.cat(feats).cpu().numpy(), fed.test.y[pos].numpy()


def feature_quality(features: np.ndarray, labels: np.ndarray, num_classes: int, seed: int = 0) -> dict[str, float]:
    """``{"feature_nmi", "feature_silhouette"}`` (module docstring) with scikit-learn."""
    if len(features) <= num_classes:   # k-means: a sample per cluster; silhouette: fewer labels than samples
        raise ConfigError(f"feature-space metrics cluster the features into {num_classes} classes and need more "
                          f"test samples than that; got {len(features)}: raise eval.features_samples (or fedhet "
                          "features --samples), or compute them on a test set with more images than classes")
    _sklearn()
    from sklearn.cluster import KMeans
    from sklearn.metrics import normalized_mutual_info_score, silhouette_score

    clusters = KMeans(n_clusters=num_classes, n_init=10, random_state=seed).fit_predict(features)
    present = len(np.unique(labels))
    return {"feature_nmi": float(normalized_mutual_info_score(labels, clusters)),
            "feature_silhouette": float(silhouette_score(features, labels)) if present > 1 else float("nan")}


def tsne_embedding(features: np.ndarray, seed: int = 0) -> np.ndarray:
    """2-d t-SNE embedding of the features (scikit-learn defaults, PCA initialisation)."""
    _sklearn()
    from sklearn.manifold import TSNE

    perplexity = min(30.0, max(2.0, (len(features) - 1) / 3))
    return TSNE(n_components=2, init="pca", perplexity=perplexity, random_state=seed).fit_transform(features)
