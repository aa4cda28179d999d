"""FedClassAvg's heterogeneous client models (Jang et al., ICPP 2022) as :class:`SplitModel` stages.

Every model here ends its body with a Linear stage ``fcin`` whose 512-d output is the feature,
with NO activation after it, and starts its head with the shared classifier stage
``classifier = Sequential(ReLU(), Linear(512, num_classes))``. The default split is
"classifier", so the head parameters are ``head.classifier.1.weight`` (num_classes x 512) and
``head.classifier.1.bias`` for every architecture: the only tensors FedClassAvg communicates.

Architectures (the authors' ``supcon_utils.define_model`` with ``feat_dim=512``, written here
without torchvision, same layer shapes):

* ``fca_resnet18``: torchvision ResNet-18 (7x7/2 stem conv + 3x3/2 max-pool), global average
  pool, ``fcin = Linear(512, 512)``.
* ``fca_shufflenetv2``: torchvision ShuffleNetV2 x1.0 (stages of 4, 8, 4 units, channels
  24-116-232-464-1024), global average pool, ``fcin = Linear(1024, 512)``.
* ``fca_googlenet``: torchvision GoogLeNet (Inception v1, including torchvision's 3x3 conv in
  the "5x5" branch), ``fcin = Linear(1024, 512)``. The two auxiliary classifiers are left out:
  they hang off inception4a/4d, never feed the main path, and the authors' training uses only
  ``.logits``, so they contribute nothing to FedClassAvg's features or loss.
* ``fca_alexnet``: the authors' custom ``alexnet_mnist(in_ch, 512)`` (three 3x3 convs,
  3x3 adaptive average pool, Linear(2304, 512) + ReLU, then ``fcin = Linear(512, 512)``), the
  same layout for 1x28x28 and 3x32x32 inputs.
* ``fca_cnn_a`` .. ``fca_cnn_d`` (:mod:`.small`): four small CNNs of different depth and width
  (80k to 340k parameters) with the same 512-d ``fcin`` and head, for fast heterogeneous runs.
* ``fca_tiny_a`` .. ``fca_tiny_d`` (:mod:`.tiny`): four CNNs each cheaper than cnn2 per sample, for
  100-round federations on one CPU core.

The four published architectures are in :mod:`.paper`, the parts they all share in :mod:`.parts`.

For 1-channel inputs the stem conv is the authors' FMNIST replacement (ResNet-18 and GoogLeNet:
``Conv2d(1, 64, 7, 2, 3)``; ShuffleNetV2: ``Conv2d(1, 24, 3, 2, 1)``), which the authors swap in
after torchvision's initialisation, so it keeps PyTorch's default init here too. Likewise
``fcin`` keeps PyTorch's default Linear init (the authors replace ``fc`` after construction);
every other layer gets torchvision's init for that model (ResNet: Kaiming-normal fan-out convs;
GoogLeNet: truncated normal, std 0.01; ShuffleNetV2 and AlexNet: PyTorch defaults).

``relu_features=True`` moves the head's ReLU to the end of the body (stage ``feature_relu``; the
head keeps an Identity in its place, so parameter names and logits are unchanged): the features
are then the input of the classifier's Linear, as prototype methods define them (FedProto's
nearest-prototype evaluation needs a one-Linear head on the features). FedClassAvg keeps the
default: its SupCon loss works on the unactivated 512-d output.

Dropout is on as published (GoogLeNet: torchvision's 0.2 after the pool, which the authors keep
when they replace ``fc``; AlexNet: the authors' 0.5 before its first Linear); the option
``dropout`` sets its rate, and ``dropout=0`` leaves the layer out. Its masks come from each
client's own stream (``fedhet.training.dropout``), so runs are reproducible for a seed and
vectorize.

``norm`` ("bn" default, as published, or "gn" with ``gn_groups``, which must divide every
channel count) applies to the ResNet, ShuffleNetV2 and GoogLeNet, which use BatchNorm; GoogLeNet
keeps torchvision's ``eps=0.001``.
"""

from fedhet.models.hetero.paper import fca_alexnet, fca_googlenet, fca_resnet18, fca_shufflenetv2
from fedhet.models.hetero.parts import FEATURE_DIM, NORMS
from fedhet.models.hetero.small import fca_cnn_a, fca_cnn_b, fca_cnn_c, fca_cnn_d
from fedhet.models.hetero.tiny import fca_tiny_a, fca_tiny_b, fca_tiny_c, fca_tiny_d

__all__ = [
    "FEATURE_DIM",
    "NORMS",
    "fca_alexnet",
    "fca_cnn_a",
    "fca_cnn_b",
    "fca_cnn_c",
    "fca_cnn_d",
    "fca_googlenet",
    "fca_resnet18",
    "fca_shufflenetv2",
    "fca_tiny_a",
    "fca_tiny_b",
    "fca_tiny_c",
    "fca_tiny_d",
]
