"""Your own data from arrays held in memory: a toy image dataset already split by user, written with
``fedhet.extend.save_arrays`` into a file that every process of a run can read.

    python examples/extending/toy_arrays.py data/toy.npz
    PYTHONPATH=examples/extending fedhet run configs/quickstart.yaml --set data.dataset=npz:data/toy.npz \\
        --set data.pool=train --set 'data.partition={kind: natural}' --set data.num_clients=8 \\
        --set train.clients_per_round=8 --set algorithm.name=feddamp:FedDamp --set train.batch_size=20 \\
        --set name=toy

Each class is a bright square at its own place on a noisy 16x16 grayscale image. Each of the
``users`` holds images of its own two favourite classes mostly (label skew, as real users have),
and ``clients_train`` says which user each training image belongs to, so the ``natural`` partition
makes one client of each user.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from fedhet.extend import save_arrays

CLASSES = 4
SIZE = 16


def images(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """uint8 images (N, 16, 16): noise, with a 6x6 square in the label's quadrant."""
    x = rng.integers(0, 90, (labels.size, SIZE, SIZE))
    for c in range(CLASSES):
        row, col = divmod(c, 2)
        x[labels == c, 2 + 8 * row:8 + 8 * row, 2 + 8 * col:8 + 8 * col] += 150
    return x.astype(np.uint8)


def toy_arrays(users: int = 8, per_user: int = 60, test: int = 200, seed: int = 0):
    """(x_train, y_train, x_test, y_test, clients_train): per_user images for each user."""
    rng = np.random.default_rng(seed)
    clients = np.repeat(np.arange(users), per_user)
    favourite = np.stack([rng.permutation(CLASSES)[:2] for _ in range(users)])
    own = rng.random(clients.size) < 0.9                    # 90% from the user's two classes
    y_train = np.where(own, favourite[clients, rng.integers(0, 2, clients.size)],
                       rng.integers(0, CLASSES, clients.size))
    y_test = rng.integers(0, CLASSES, test)
    return images(y_train, rng), y_train, images(y_test, rng), y_test, clients


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python toy_arrays.py OUT.npz")
    x_train, y_train, x_test, y_test, clients = toy_arrays()
    Path(sys.argv[1]).parent.mkdir(parents=True, exist_ok=True)
    name = save_arrays(sys.argv[1], x_train, y_train, x_test, y_test, clients_train=clients, num_classes=CLASSES)
    print(f"wrote {len(y_train)} training images of {clients.max() + 1} users and {len(y_test)} test images: "
          f"data.dataset={name}")
