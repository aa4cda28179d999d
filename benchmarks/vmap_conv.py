"""How fast is one vmapped training step of cnn2 with each way of computing its convolutions?

Under ``torch.func.vmap`` a convolution whose weights differ per client becomes one grouped
convolution (groups = clients). On CUDA, cuDNN's heuristics run it as one kernel per group, and a
first layer with one input channel becomes a depthwise convolution, which PyTorch sends to its own
(slow) depthwise kernel instead of cuDNN. This script times one SGD step of C clients (forward,
per-client cross-entropy, gradients, update), captured as a CUDA graph as the vectorized engine
runs it, with the convolutions computed:

* ``native``: as the engine does by default (cuDNN's heuristic choice, PyTorch's depthwise kernel);
* ``benchmark``: the same with ``torch.backends.cudnn.benchmark`` (cuDNN times its algorithms);
* ``matmul_conv1`` / ``matmul``: the first / every convolution as im2col (``F.unfold``) and one
  batched matrix product per client (:func:`matmul_conv2d` below).

Each variant starts from the same weights and batch; the script reports ms per step (median of
``--repeats`` timings of ``--steps`` graph replays, CUDA events) and the largest difference of the
weights after one step from the native variant's.

    python benchmarks/vmap_conv.py --out DIR [--clients 10 --batch 32 --device cuda]

On the CPU it runs the same code eagerly (a dry run: no graphs, no timing worth quoting).

Every variant runs with TF32 off (``strict_fp32``), as the engine trains in fp32. Measured on an
H200 before that was so (benchmarks/results/gpu_h200_2026-11-27b/, cuDNN free to use TF32):
the grouped convolutions were the fastest of the four (cnn2, 10 clients x 32: 1.15 ms a step;
matmul 6.27 ms; cudnn.benchmark changed nothing); whole FedCME runs in the engine's strict fp32 were
2.4x slower a round with matmul, so the vectorized engine keeps ``F.conv2d``."""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collect import machine_info  # noqa: E402

from fedhet.models import build_model  # noqa: E402
from fedhet.training.precision import strict_fp32  # noqa: E402


def matmul_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None, stride: tuple[int, int],
                  padding: tuple[int, int], dilation: tuple[int, int]) -> Tensor:
    """``F.conv2d`` (groups 1, zero padding) as im2col (``F.unfold``) and one matrix product.

    The same function of ``x`` and the weights as the convolution, rounded differently. Under
    ``torch.func.vmap`` with per-client weights it becomes one batched product per client,
    where ``F.conv2d`` becomes a grouped convolution."""
    n, _, h, w = x.shape
    cout, _, kh, kw = weight.shape
    ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    cols = F.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)    # (N, Cin*kh*kw, L)
    k = cols.shape[1]
    out = weight.reshape(cout, k) @ cols.transpose(0, 1).reshape(k, n * ho * wo)     # one product: (Cout, N*L)
    out = out.view(cout, n, ho, wo).transpose(0, 1)
    return out if bias is None else out + bias.view(1, cout, 1, 1)


class MatmulConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` computed by :func:`matmul_conv2d`; the same parameters and names."""

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return matmul_conv2d(input, weight, bias, self.stride, self.padding, self.dilation)  # type: ignore[arg-type]


def use_matmul_convs(model: nn.Module, first_only: bool = False) -> nn.Module:
    """A copy of ``model`` whose convolutions (groups 1, numeric zero padding; with
    ``first_only`` only the first) run as :class:`MatmulConv2d`; parameter names unchanged."""
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if (type(m) is nn.Conv2d and m.groups == 1 and m.padding_mode == "zeros"
                and not isinstance(m.padding, str)):
            m.__class__ = MatmulConv2d
            if first_only:
                break
    return twin


def make_step(model, names, lr):
    def client_loss(w, x, y):
        return F.cross_entropy(functional_call(model, w, (x,)), y)

    def step(weights, x, y):
        w = {n: t.detach().requires_grad_(True) for n, t in weights.items()}
        losses = vmap(client_loss)(w, x, y)
        grads = torch.autograd.grad(losses.sum(), [w[n] for n in names])
        with torch.no_grad():
            for n, g in zip(names, grads):
                weights[n].sub_(lr * g)
        return losses.detach()
    return step


def run_variant(name, base_model, init, x, y, args, device):
    model = base_model
    torch.backends.cudnn.benchmark = name == "benchmark"
    if name.startswith("matmul"):
        model = use_matmul_convs(base_model, first_only=name == "matmul_conv1")
    names = list(init)
    weights = {n: t.clone() for n, t in init.items()}
    step = make_step(model, names, args.lr)
    step(weights, x, y)                                  # the one step whose result is compared
    after_one = {n: t.clone() for n, t in weights.items()}
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(weights, x, y)
        return after_one, [1000 * (time.perf_counter() - t0) / args.steps], "eager (CPU dry run)"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(weights, x, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(weights, x, y)
    times = []
    for _ in range(args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / args.steps)
    return after_one, times, "graph"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="cnn2")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default="native,benchmark,matmul_conv1,matmul")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(args.arch, in_channels=1, num_classes=10, image_size=28).to(device)
    C, B = args.clients, args.batch
    init = {n: t.detach().unsqueeze(0).repeat(C, *[1] * t.dim()) + 0.01 * torch.randn(C, *t.shape, device=device)
            for n, t in model.named_parameters()}
    x = torch.randn(C, B, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (C, B), device=device)
    rows, reference = [], None
    for name in args.variants.split(","):
        with strict_fp32(device):             # TF32 off, as the engine trains in fp32
            after_one, times, how = run_variant(name, model, init, x, y, args, device)
        if reference is None:
            reference = after_one
        diff = max(float((after_one[n] - reference[n]).abs().max()) for n in reference)
        row = {"variant": name, "ms_per_step": statistics.median(times), "timings_ms": times, "how": how,
               "max_weight_diff_vs_first": diff, "samples_per_s": C * B / (statistics.median(times) / 1000)}
        rows.append(row)
        print(f"{name:14s} {row['ms_per_step']:8.3f} ms/step  {row['samples_per_s']:10.0f} samples/s  "
              f"max |dw| vs {args.variants.split(',')[0]}: {diff:.2e}  ({how})", flush=True)
    torch.backends.cudnn.benchmark = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(), "arch": args.arch,
              "clients": C, "batch": B, "rows": rows}
    (out / "vmap_conv.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
