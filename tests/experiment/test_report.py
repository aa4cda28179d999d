"""fedhet.experiment.report's shared pieces: mean ± std over seeds, and reading a folder of runs (what
`fedhet compare` and the per-paper table scripts in benchmarks/ use)."""

from __future__ import annotations

import json
import shutil

import pytest

from fedhet.experiment.report import (
    format_mean_std,
    format_value,
    mean_std,
    provenance_lines,
    read_run_folder,
    unfinished_lines,
)
from fedhet.experiment.summary import cpu_fields, cpu_isa, cpu_model, cpu_name


def test_mean_std_over_seeds_by_hand():
    # 0.80, 0.82, 0.84: mean 0.82; deviations -0.02, 0, +0.02, squares 0.0008 in all, / (3 - 1) = 0.0004, std 0.02
    mean, std = mean_std([0.80, 0.82, 0.84])
    assert mean == pytest.approx(0.82)
    assert std == pytest.approx(0.02)
    assert mean_std([0.7]) == (0.7, None)            # one seed: no std
    with pytest.raises(ValueError):
        mean_std([])


def test_format_mean_std_as_percent_or_as_given():
    assert format_mean_std([0.80, 0.82, 0.84]) == "82.00 ± 2.00"
    # 0.3, 0.5 unscaled: mean 0.4; deviations -0.1, +0.1, squares 0.02, / 1, std sqrt(0.02) = 0.1414
    assert format_mean_std([0.3, 0.5], 1, ".3f") == "0.400 ± 0.141"
    assert format_mean_std([0.8125]) == "81.25"
    assert format_mean_std([]) == "-"
    assert format_mean_std([0.8, None]) == "-"        # a seed without the metric: no mean of the others
    assert format_value(0.1234) == "12.34"
    assert format_value(1.5, 1, ".3f") == "1.500"
    assert format_value(None) == "-"


def _summary(name: str, status: str, rounds: int, error: str | None = None) -> str:
    return json.dumps({"name": name, "status": status, "rounds_completed": rounds, "error": error, "metrics": {}})


def test_read_run_folder_splits_completed_from_unfinished(tmp_path):
    (tmp_path / "b_s0").mkdir()
    (tmp_path / "b_s0" / "summary.json").write_text(_summary("b", "completed", 3))
    (tmp_path / "a_s0").mkdir()
    (tmp_path / "a_s0" / "summary.json").write_text(_summary("a", "failed", 2, "diverged (NaN)"))
    (tmp_path / "c_s0").mkdir()                                       # started, no summary yet: 2 rounds recorded
    (tmp_path / "c_s0" / "metrics.jsonl").write_text('{"round": 1}\n{"round": 2}\n')
    (tmp_path / "d_s0").mkdir()
    (tmp_path / "d_s0" / "summary.json").write_text(_summary("d", "interrupted", 1))
    (tmp_path / "sweep.md").write_text("not a run")                    # files beside the runs are no runs

    completed, unfinished = read_run_folder(tmp_path)
    assert [(d.name, s["name"]) for d, s in completed] == [("b_s0", "b")]
    assert unfinished == [("a_s0", 2, "diverged (NaN)"), ("c_s0", 2, "no summary.json"), ("d_s0", 1, "interrupted")]
    assert unfinished_lines(unfinished)[1:] == [
        "Runs that did not finish (left out of the table above):", "",
        "- `a_s0`: 2 rounds recorded; diverged (NaN)", "- `c_s0`: 2 rounds recorded; no summary.json",
        "- `d_s0`: 1 rounds recorded; interrupted"]
    assert unfinished_lines([]) == []


def test_provenance_names_the_commit_and_cpu_of_every_run(tmp_path):
    """A table made of runs from two machines and two commits says so, with how many runs each; the
    config shown is the first run's."""
    made = [("aaa", "Intel Xeon"), ("bbb", "AMD EPYC"), ("bbb", "AMD EPYC")]
    runs = []
    for i, (commit, cpu) in enumerate(made):
        run = tmp_path / f"r{i}"
        run.mkdir()
        (run / "summary.json").write_text(json.dumps({"name": f"r{i}", "metrics": {},
                                                      "machine": {"commit": commit, "cpu_model": cpu}}))
        (run / "config.yaml").write_text(f"name: r{i}\n")
        runs.append(run)
    lines = provenance_lines(runs, "the seed", {"processor": "x86_64", "cpus": 2, "torch": "2"})
    assert lines[1].startswith("Runs made at aaa on Intel Xeon (1 run); bbb on AMD EPYC (2 runs); the table made on ")


# /proc/cpuinfo as two kinds of 2-core machine write it (flags cut to those that matter and a few others);
# the second processor's block must not be read.
ZEN5_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC 9B45
flags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_bf16 avx512_vnni

processor\t: 1
cpu family\t: 25
model\t\t: 1
flags\t\t: fpu avx2
"""
XEON_CPUINFO = """processor\t: 0
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def test_cpu_isa_tells_apart_what_the_model_name_does_not():
    assert cpu_isa(cpu_fields(ZEN5_CPUINFO)) == "AVX512, bf16; family 26 model 2"
    assert cpu_isa(cpu_fields(XEON_CPUINFO)) == "AVX512, bf16, amx; family 6 model 143"
    assert cpu_isa(cpu_fields("cpu family\t: 23\nmodel\t\t: 49\nflags\t\t: fpu sse2 avx avx2\n")) == "AVX2; family 23 model 49"
    assert cpu_isa(cpu_fields("flags\t\t: fpu sse2\n")) == "no AVX2"
    # AMX is its tile unit (amx_tile); amx_bf16 alone names the data type, not the unit
    assert cpu_isa(cpu_fields("flags\t\t: avx2 amx_bf16\n")) == "AVX2"
    assert cpu_isa(cpu_fields("")) == ""
    assert cpu_model(cpu_fields(ZEN5_CPUINFO)) == "AMD EPYC 9B45"         # the first block's name
    assert cpu_name({"cpu_model": "AMD EPYC", "cpu_isa": "AVX512, bf16; family 26 model 2"}) == \
        "AMD EPYC (AVX512, bf16; family 26 model 2)"
    assert cpu_name({"cpu_model": "AMD EPYC"}) == "AMD EPYC"            # a summary written before cpu_isa
    assert cpu_name({"processor": "x86_64"}) == "x86_64"


def test_provenance_names_the_instruction_set_where_a_run_recorded_it(tmp_path):
    """Two runs on "AMD EPYC"s of other generations are two machines in the provenance line."""
    runs = []
    for i, isa in enumerate(["AVX2; family 25 model 1", "AVX512, bf16; family 26 model 2"]):
        run = tmp_path / f"r{i}"
        run.mkdir()
        (run / "summary.json").write_text(json.dumps({"name": f"r{i}", "metrics": {}, "machine": {
            "commit": "ccc", "cpu_model": "AMD EPYC", "cpu_isa": isa}}))
        (run / "config.yaml").write_text(f"name: r{i}\n")
        runs.append(run)
    lines = provenance_lines(runs, "the seed", {"processor": "x86_64", "cpu_model": "AMD EPYC", "cpus": 2, "torch": "2"})
    assert lines[1].startswith("Runs made at ccc on AMD EPYC (AVX2; family 25 model 1) (1 run); ccc on AMD EPYC "
                               "(AVX512, bf16; family 26 model 2) (1 run); the table made on AMD EPYC, 2 CPUs, torch 2, "
                               "at commit ")
    assert lines[lines.index("```yaml") + 1] == "name: r0"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_recorded_commit_says_when_the_source_differs_from_it(tmp_path, monkeypatch):
    import subprocess

    from fedhet.experiment.summary import git_commit

    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))     # no checkout above tmp_path counts
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    repo.mkdir(), outside.mkdir()

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
                       cwd=repo, check=True, capture_output=True)

    def commit_of(folder):
        git_commit.cache_clear()                 # read once per process: clear it for each state here
        return git_commit(folder)

    git("init", "-q")
    (repo / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                          text=True).stdout.strip()
    assert commit_of(repo) == head
    (repo / "new.py").write_text("y = 1\n")                      # a new file counts
    assert commit_of(repo) == f"{head}-dirty"
    (repo / "new.py").unlink()
    (repo / "code.py").write_text("x = 2\n")
    assert commit_of(repo) == f"{head}-dirty"
    assert commit_of(outside) is None
    git_commit.cache_clear()
