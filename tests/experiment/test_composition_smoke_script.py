"""scripts/composition_smoke.py: runs an accepted pair on its toy set and records it; a pair the
run refuses as it is built is recorded apart from the failures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "composition_smoke.py"


def load():
    spec = importlib.util.spec_from_file_location("composition_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_pair_runs_two_rounds_on_the_toy_set_and_a_second_call_goes_on_from_the_results(tmp_path, capsys):
    smoke = load()
    results = tmp_path / "r.jsonl"
    assert smoke.main(["--pairs", "fedprox+fedlc", "--results", str(results)]) == 0
    (row,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert row["pair"] == "fedprox+fedlc" and row["status"] == "completed" and len(row["train_loss"]) == 2
    assert "1 completed, 0 refused as built, 0 failed" in capsys.readouterr().out
    assert smoke.main(["--pairs", "fedprox+fedlc", "--results", str(results)]) == 0      # nothing left to run
    assert len(results.read_text().splitlines()) == 1
    results.write_text(json.dumps({"pair": "fedprox+fedlc", "status": "error", "error": "KeyError: 'x'",
                                   "where": "fedhet/algorithms/fedprox.py:1"}) + "\n")
    assert smoke.main(["--pairs", "fedprox+fedlc", "--results", str(results)]) == 1      # a recorded failure counts
    assert "fedprox+fedlc: error KeyError: 'x' fedhet/algorithms/fedprox.py:1" in capsys.readouterr().out


def test_a_method_alone_runs_with_a_parameter_changed_and_a_bad_parameter_is_refused(tmp_path, capsys):
    smoke = load()
    results = tmp_path / "alone.jsonl"
    assert smoke.main(["--alone", "fedprox", "--param", "fedprox.mu=0.5", "--results", str(results)]) == 0
    (row,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert row["pair"] == "fedprox" and row["status"] == "completed"
    assert smoke.pair_config(("fedprox",), "npz:x", tmp_path)["algorithm"]["params"] == {"mu": 0.5}
    try:
        smoke.main(["--alone", "fedprox", "--param", "mu=0.5", "--results", str(results)])
    except SystemExit as e:
        assert e.code == 2 and "write METHOD.KEY=VALUE" in capsys.readouterr().err
    else:
        raise AssertionError("a --param without its method was accepted")
