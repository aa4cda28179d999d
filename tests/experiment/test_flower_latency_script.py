"""benchmarks/flower_latency.py --write-config: the YAML a memory measurement deploys is the
benchmark's own config, key for key."""

from __future__ import annotations

from helpers import benchmark_script

from fedhet.experiment.build import make_algorithm
from fedhet.experiment.config import load_config


def test_the_written_config_is_the_benchmarks_config(tmp_path):
    script = benchmark_script("flower_latency")
    out = tmp_path / "flower_small.yaml"
    assert script.main(["--algorithms", "fedcme", "fedavg", "--rounds", "2", "--write-config", str(out)]) == 0
    written = load_config(out)
    assert written == script.bench_config("fedcme", 2, None)
    assert written.algorithm.name == "fedcme" and written.train.rounds == 2 and written.data.num_clients == 3


def test_the_benchmarks_configs_pass_their_methods_set_up_checks():
    """make_algorithm runs each method's schedule check (FedCME refuses one local epoch), which
    the benchmark would otherwise meet only after its first deployment."""
    script = benchmark_script("flower_latency")
    for algorithm in ("fedavg", "fedcme"):
        assert make_algorithm(script.bench_config(algorithm, 3, None)).name == algorithm
