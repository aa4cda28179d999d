"""A sweep's verdicts (rules written into the sweep file), decided from completed runs wherever they
were made, and run folders kept with their small files only (as the repository keeps them)."""

from __future__ import annotations

import json
import shutil
import tarfile

import pytest
from helpers import write_metrics
from test_sweep import write_sweep

from fedhet.cli import main as cli_main
from fedhet.core.errors import ConfigError
from fedhet.experiment.sweep import KEPT_FILES, adopt_runs, job_status, load_sweep, run_sweep
from fedhet.experiment.verdict import Verdict, decide, parse_verdicts, run_value

RUNS = {(tag, seed) for tag in ("a", "b", "c") for seed in (0, 1)}


def values(table):
    return lambda tag, seed: table.get((tag, seed))


def test_every_seed_needs_every_pair_and_one_direction():
    v = Verdict("a > b", "every_seed", "a", ("b",), (0, 1))
    assert decide(v, values({("a", 0): 0.8, ("b", 0): 0.7, ("a", 1): 0.6, ("b", 1): 0.5}))[0] == "reproduced"
    assert decide(v, values({("a", 0): 0.6, ("b", 0): 0.7, ("a", 1): 0.4, ("b", 1): 0.5}))[0] == "not reproduced"
    outcome, detail = decide(v, values({("a", 0): 0.8, ("b", 0): 0.7, ("a", 1): 0.4, ("b", 1): 0.5}))
    assert outcome == "inconclusive" and detail == "b s0: +10.00, b s1: -10.00"
    # an exact tie at one seed is neither direction
    assert decide(v, values({("a", 0): 0.8, ("b", 0): 0.7, ("a", 1): 0.5, ("b", 1): 0.5}))[0] == "inconclusive"
    outcome, detail = decide(v, values({("a", 0): 0.8, ("b", 0): 0.7, ("a", 1): 0.6}))
    assert outcome == "pending" and detail == "needs b_s1"


def test_best_at_seed_reads_differences_within_the_margin_as_a_tie():
    v = Verdict("a best", "best_at_seed", "a", ("b", "c"), (0,), margin=0.01)
    assert decide(v, values({("a", 0): 0.80, ("b", 0): 0.78, ("c", 0): 0.70}))[0] == "reproduced"
    assert decide(v, values({("a", 0): 0.80, ("b", 0): 0.795, ("c", 0): 0.70}))[0] == "tie"
    assert decide(v, values({("a", 0): 0.80, ("b", 0): 0.815, ("c", 0): 0.70}))[0] == "not reproduced"


def test_complete_pairs_of_a_pending_claim_decide_what_no_later_seed_can_change():
    """every_seed: one pair at or below rules "reproduced" out, and the claim stays pending while the
    rest may still decide between "not reproduced" and "inconclusive"; a pair at or below and one at or
    above make it "inconclusive" whatever the missing seeds give. best_at_seed: one loss beyond the
    margin is "not reproduced" whatever the other seeds give, and one within the margin rules "reproduced"
    out. Pairs above (by the margin) alone decide nothing early."""
    v = Verdict("a > b", "every_seed", "a", ("b",), (0, 1, 2))
    outcome, detail = decide(v, values({("a", 0): 0.6, ("b", 0): 0.7, ("a", 2): 0.5}))
    assert outcome == "pending" and detail == "needs a_s1, b_s1, b_s2; reproduced is already ruled out by b s0: -10.00"
    outcome, detail = decide(v, values({("a", 0): 0.6, ("b", 0): 0.7, ("a", 1): 0.8, ("b", 1): 0.7, ("a", 2): 0.5}))
    assert outcome == "inconclusive" and detail == "b s0: -10.00, b s1: +10.00 (decided before b_s2 ran)"
    # an exact tie rules out both directions on its own
    outcome, detail = decide(v, values({("a", 0): 0.7, ("b", 0): 0.7}))
    assert outcome == "inconclusive" and detail == "b s0: +0.00 (decided before a_s1, a_s2, b_s1, b_s2 ran)"
    outcome, detail = decide(v, values({("a", 0): 0.8, ("b", 0): 0.7, ("a", 2): 0.5}))
    assert outcome == "pending" and detail == "needs a_s1, b_s1, b_s2"
    best = Verdict("a best", "best_at_seed", "a", ("b", "c"), (0, 1), margin=0.01)
    outcome, detail = decide(best, values({("a", 0): 0.80, ("b", 0): 0.815, ("c", 0): 0.70}))
    assert outcome == "not reproduced"
    assert detail == "b s0: -1.50, c s0: +10.00 (decided before a_s1, b_s1, c_s1 ran)"
    # within the margin at one seed: "reproduced" is out, "tie" and "not reproduced" are still open
    outcome, detail = decide(best, values({("a", 0): 0.80, ("b", 0): 0.805, ("c", 0): 0.70}))
    assert outcome == "pending" and detail == ("needs a_s1, b_s1, c_s1; reproduced is already ruled out by b s0: -0.50 "
                                               "(within the 1-point margin), so the outcome is tie or not reproduced")
    outcome, detail = decide(best, values({("a", 0): 0.80, ("b", 0): 0.785, ("c", 0): 0.70}))
    assert outcome == "pending" and detail == "needs a_s1, b_s1, c_s1"


def test_most_seeds_reproduces_at_every_seed_and_fails_at_half_or_fewer():
    """most_seeds over 3 seeds: ahead at 3 reproduced, at 2 inconclusive, at 1 or 0 not reproduced (an
    exact tie is not ahead); with 4 seeds, ahead at 2 is no more than half. Decided early once the missing
    pairs cannot lift "ahead" past half, or once more than half are ahead and one is not."""
    v = Verdict("a > b", "most_seeds", "a", ("b",), (0, 1, 2))
    def run(*diffs):
        return decide(v, values({**{("b", s): 0.5 for s in range(3)},
                                 **{("a", s): 0.5 + d for s, d in enumerate(diffs) if d is not None}}))
    assert run(0.1, 0.1, 0.1)[0] == "reproduced"
    assert run(0.1, -0.1, 0.1) == ("inconclusive", "b s0: +10.00, b s1: -10.00, b s2: +10.00")
    assert run(0.1, 0.0, 0.1)[0] == "inconclusive"
    assert run(0.1, -0.1, -0.1)[0] == "not reproduced"
    assert run(-0.1, -0.1, -0.1)[0] == "not reproduced"
    assert run(-0.1, -0.1, None) == ("not reproduced", "b s0: -10.00, b s1: -10.00 (decided before a_s2 ran)")
    assert run(-0.1, None, None) == ("pending", "needs a_s1, a_s2; reproduced is already ruled out")
    assert run(0.1, 0.1, None) == ("pending", "needs a_s2")
    five = Verdict("a > b", "most_seeds", "a", ("b",), (0, 1, 2, 3, 4))
    table = {**{("b", s): 0.5 for s in range(5)}, ("a", 0): 0.6, ("a", 1): 0.6, ("a", 2): 0.6, ("a", 3): 0.4}
    assert decide(five, values(table))[0] == "inconclusive"          # 3 of 5 ahead, one not: seed 4 cannot change it
    even = Verdict("a > b", "most_seeds", "a", ("b",), (0, 1, 2, 3))
    table = {**{("b", s): 0.5 for s in range(4)}, ("a", 0): 0.6, ("a", 1): 0.6, ("a", 2): 0.4, ("a", 3): 0.4}
    assert decide(even, values(table))[0] == "not reproduced"
    del table[("a", 1)]                                              # 1 of 3 ahead: seed 1 can make it 2 of 4, half
    assert decide(even, values(table)) == ("not reproduced", "b s0: +10.00, b s2: -10.00, b s3: -10.00 "
                                                             "(decided before a_s1 ran)")


def test_a_verdict_is_checked_when_the_sweep_file_is_read():
    good = {"claim": "x", "rule": "every_seed", "better": "a", "than": "b", "seeds": [0]}
    (v,) = parse_verdicts([good], "f", RUNS)
    assert v.than == ("b",) and v.value == "final" and v.margin == 0.0
    for bad, message in [({**good, "better": "z"}, "'z' is not a tag"), ({**good, "rule": "most"}, "rule 'most'"),
                         ({**good, "seeds": []}, "seeds must be"), ({**good, "seeds": [True]}, "seeds must be"),
                         ({**good, "value": "lowest:"}, "value 'lowest:'"), ({**good, "value": "top:x"}, "value 'top:x'"),
                         ({**good, "margin": -1}, "margin"),
                         ({**good, "typo": 1}, "unknown keys"), ({"claim": "x"}, "needs rule, better, than, seeds"),
                         ({**good, "than": []}, "'than' names no tag"),
                         ({**good, "seeds": [0, 2]}, "the sweep runs no a_s2, b_s2")]:
        with pytest.raises(ConfigError, match=message):
            parse_verdicts([bad], "f", RUNS)
    with pytest.raises(ConfigError, match="must be a list"):
        parse_verdicts({"claim": "x"}, "f", RUNS)


def test_value_at_the_round_where_another_metric_is_lowest_or_highest(tmp_path):
    rows = [{"round": 1, "personal_loss": 0.9, "personal_acc": 0.5}, {"round": 2, "personal_loss": 0.4, "personal_acc": 0.7},
            {"round": 3, "personal_loss": 0.4, "personal_acc": 0.9}, {"round": 4, "personal_acc": 0.95}]
    write_metrics(tmp_path, rows)
    summary = {"metrics": {"personal_acc": {"final": 0.92, "best": 0.95}}}
    assert run_value(tmp_path, summary, "personal_acc", "lowest:personal_loss") == 0.7    # the first lowest round
    assert run_value(tmp_path, summary, "personal_acc", "highest:personal_loss") == 0.5   # the highest one
    rows[2]["global_val_acc"], rows[3]["global_val_acc"] = 0.8, 0.8
    write_metrics(tmp_path, rows)
    assert run_value(tmp_path, summary, "personal_acc", "highest:global_val_acc") == 0.9  # the first highest round
    assert run_value(tmp_path, summary, "personal_acc", "final") == 0.92
    assert run_value(tmp_path, summary, "personal_acc", "best") == 0.95
    assert run_value(tmp_path, summary, "global_acc", "final") is None


def test_runs_kept_as_small_files_elsewhere_are_adopted_skipped_and_decide_the_verdict(tmp_path, small_config,
                                                                                        capsys):
    """The repository's way: a sweep runs on one machine, its folders travel with their small files only
    (an archive, as a GPU call returns them), and another checkout adopts them: nothing is run again there,
    and the table decides the sweep file's verdict from them."""
    verdict = {"claim": "fedprox > fedavg", "rule": "every_seed", "better": "fedprox", "than": "fedavg", "seeds": [0]}
    misspelt = {**verdict, "claim": "a metric no run has", "metric": "global_accc"}
    path = write_sweep(tmp_path, small_config, [("fedavg", {}), ("fedprox", {})], set=["train.rounds=2"],
                       verdicts=[verdict, misspelt])
    elsewhere = load_sweep(path, out=tmp_path / "elsewhere")
    run_sweep(elsewhere, log=lambda m: None, poll_seconds=0.2)
    assert all((j.run_dir / "checkpoint.pt").is_file() for j in elsewhere.jobs)
    archive = tmp_path / "sweep0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(elsewhere.out, arcname="sweep0")

    assert cli_main(["sweep", str(path), "--adopt", str(archive)]) == 0
    sweep = load_sweep(path)
    for job in sweep.jobs:
        assert sorted(p.name for p in job.run_dir.iterdir()) == sorted(KEPT_FILES)
        assert job_status(job) == "completed"
    messages = []
    assert run_sweep(sweep, log=messages.append, poll_seconds=0.2) == {}
    assert "2 completed left alone, 0 to run" in messages[0]
    said = []
    assert adopt_runs(sweep, archive, log=said.append) == []          # already there: left alone
    assert said == [f"--adopt {archive}: 0 run(s) adopted; 2 already completed here, 0 there not completed or of "
                    "another config, 0 not there"]

    capsys.readouterr()
    assert cli_main(["sweep", str(path), "--table"]) == 0
    table = capsys.readouterr().out
    summaries = {j.tag: json.loads((j.run_dir / "summary.json").read_text()) for j in sweep.jobs}
    metric = summaries["fedavg"]["headline_metric"]
    finals = {tag: s["metrics"][metric]["final"] for tag, s in summaries.items()}
    expected = ("reproduced" if finals["fedprox"] > finals["fedavg"] else
                "not reproduced" if finals["fedprox"] < finals["fedavg"] else "inconclusive")
    assert f"| fedprox > fedavg | every_seed, seeds [0] | headline (final) | **{expected}** |" in table
    assert f"fedavg s0: {100 * (finals['fedprox'] - finals['fedavg']):+.2f}" in table
    assert "| a metric no run has | every_seed, seeds [0] | global_accc (final) | **cannot be decided** | " \
           "fedprox_s0 recorded no global_accc (final); it has: " in table, table


def test_a_run_of_another_config_is_not_adopted(tmp_path, small_config):
    path = write_sweep(tmp_path, small_config, [("fedavg", {})], set=["train.rounds=2"])
    other = load_sweep(path, out=tmp_path / "elsewhere", extra_set=["train.lr=0.01"])
    run_sweep(other, log=lambda m: None, poll_seconds=0.2)
    sweep = load_sweep(path)
    said = []
    assert adopt_runs(sweep, other.out, log=said.append) == []
    assert not sweep.jobs[0].run_dir.exists()
    assert said == [f"--adopt {other.out}: 0 run(s) adopted; 0 already completed here, 1 there not completed or of "
                    "another config (fedavg_s0 (stale)), 0 not there"]
    said.clear()            # a folder one level off (the sweeps' parent) holds none of its runs: said so
    assert adopt_runs(sweep, tmp_path, log=said.append) == []
    assert said == [f"--adopt {tmp_path}: 0 run(s) adopted; 0 already completed here, 0 there not completed or of "
                    "another config, 1 not there: it holds no folder named like a run of sweep 'tiny', e.g. fedavg_s0"]
    with pytest.raises(ConfigError, match="not a readable .tar.gz"):
        bad = tmp_path / "bad.tar.gz"
        bad.write_text("not an archive")
        adopt_runs(sweep, bad)
    shutil.rmtree(other.out)
    with pytest.raises(ConfigError, match="no such folder or archive"):
        adopt_runs(sweep, other.out)


def test_one_run_folder_given_to_adopt_adopts_that_run_alone(tmp_path, small_config):
    path = write_sweep(tmp_path, small_config, [("fedavg", {}), ("fedprox", {})], set=["train.rounds=1"])
    elsewhere = load_sweep(path, out=tmp_path / "elsewhere")
    run_sweep(elsewhere, log=lambda m: None, poll_seconds=0.2)
    sweep = load_sweep(path)
    said = []
    assert adopt_runs(sweep, elsewhere.out / "fedprox_s0", log=said.append) == ["fedprox_s0"]
    assert said[-1] == (f"--adopt {elsewhere.out / 'fedprox_s0'}: 1 run(s) adopted; 0 already completed here, 0 there "
                        "not completed or of another config, 0 not there")
    assert [job_status(j) for j in sweep.jobs] == ["new", "completed"]          # fedavg_s0 left where it is
