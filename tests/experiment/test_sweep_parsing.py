"""A sweep's status reads configs through libyaml and a cache (sweep._parsed_yaml, current_config):
the same objects and the same errors as parse_yaml and load_config, and an edited file is read anew."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fedhet.core.errors import ConfigError
from fedhet.experiment.config import dump_config, load_config
from fedhet.experiment.sweep import Job, config_mismatch, job_status
from fedhet.experiment.sweep.state import _parsed_yaml, current_config
from fedhet.experiment.yaml_io import _parse_yaml_pure as parse_yaml  # the reference: PyYAML's own parser

ROOT = Path(__file__).resolve().parents[2]


def every_yaml_file() -> list[Path]:
    """The repository's configs, sweep files and the recorded configs of its committed runs."""
    files = [*ROOT.glob("configs/**/*.yaml"), *ROOT.glob("benchmarks/*.yaml"),
             *ROOT.glob("benchmarks/runs/**/config.yaml"), *ROOT.glob("examples/**/*.yaml")]
    return sorted(files)


def test_every_yaml_file_of_the_repository_reads_as_parse_yaml_reads_it():
    files = every_yaml_file()
    assert len(files) > 50
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert _parsed_yaml(text) == parse_yaml(text), path


def test_a_dumped_config_and_the_yaml_11_corner_cases_read_the_same():
    text = dump_config(load_config(ROOT / "configs/quickstart.yaml", ["train.lr=5e-3", "algorithm.params={mu: 1e-2}"]))
    assert _parsed_yaml(text) == parse_yaml(text)
    corners = ("a: 5e-1\nb: 1E3\nc: -2.5e+2\nd: yes\ne: off\nf: ~\ng: 0x1f\nh: 010\ni: 1_000\nj: .inf\nk: 2001-12-14\n"
               "l: '5e-1'\nm: [1, {n: o}]\np: !!str 3\nq: |\n  text\n  more\nr: 12:30:00\n")
    assert _parsed_yaml(corners) == parse_yaml(corners)
    assert _parsed_yaml(corners)["a"] == 0.5 and isinstance(_parsed_yaml(corners)["b"], float)


@pytest.mark.parametrize("text", ["train: {lr: 1}\ntrain: {lr: 2}\n", "a: [1, 2\n", "a: b: c\n", "\tkey: 1\n",
                                  "a: !!python/object:os.system x\n"])
def test_a_text_that_does_not_parse_raises_parse_yamls_own_error(text):
    with pytest.raises(yaml.YAMLError) as expected:
        parse_yaml(text)
    with pytest.raises(yaml.YAMLError) as got:
        _parsed_yaml(text)
    assert type(got.value) is type(expected.value) and str(got.value) == str(expected.value)


def test_the_current_config_of_a_job_is_load_configs_and_an_edited_file_is_read_anew(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("name: x\ntrain: {rounds: 3, lr: 0.1}\n")
    job = Job("x", 0, config, ["train.lr=0.2", "seed=0"], tmp_path / "x_s0")
    assert current_config(job) == load_config(config, job.overrides)
    assert current_config(job).train.lr == 0.2
    config.write_text("name: x\ntrain: {rounds: 4, lr: 0.1}\n")      # the same size: edited within a tick
    assert current_config(job).train.rounds == 4


@pytest.mark.parametrize("content", [b"", b"- a\n- b\n", b"train: {rounds: 3\n", b"name: \xe9\n", b"name: a\x00\n",
                                     b"train: {rounds: 3}\ntrain: {lr: 1}\n", b"train: {rounds: -1}\n"])
def test_a_config_that_does_not_load_raises_load_configs_own_error(tmp_path, content):
    config = tmp_path / "c.yaml"
    config.write_bytes(content)
    job = Job("x", 0, config, ["seed=0"], tmp_path / "x_s0")
    with pytest.raises(ConfigError) as expected:
        load_config(config, job.overrides)
    with pytest.raises(ConfigError) as got:
        current_config(job)
    assert str(got.value) == str(expected.value)


def test_missing_and_folder_configs_raise_as_load_config_does(tmp_path):
    for path in (tmp_path / "absent.yaml", tmp_path):
        job = Job("x", 0, path, [], tmp_path / "x_s0")
        with pytest.raises(ConfigError) as expected:
            load_config(path, [])
        with pytest.raises(ConfigError) as got:
            current_config(job)
        assert str(got.value) == str(expected.value)


def test_status_of_a_recorded_run_follows_edits_of_its_config_and_of_the_sweeps(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("name: x\ntrain: {rounds: 3, lr: 0.1}\n")
    job = Job("x", 0, config, ["seed=0"], tmp_path / "x_s0")
    job.run_dir.mkdir()
    (job.run_dir / "config.yaml").write_text(dump_config(load_config(config, job.overrides)))
    (job.run_dir / "summary.json").write_text('{"status": "completed", "rounds_completed": 3}')
    assert job_status(job) == "completed" and config_mismatch(job) == []
    config.write_text("name: x\ntrain: {rounds: 3, lr: 0.2}\n")
    assert job_status(job) == "stale" and config_mismatch(job) == ["train.lr: 0.1 -> 0.2"]
    config.write_text("name: x\ntrain: {rounds: 5, lr: 0.1}\n")
    assert job_status(job) == "extend"
    (job.run_dir / "config.yaml").write_text(dump_config(load_config(config, ["seed=0", "train.lr=0.3"])))
    assert job_status(job) == "stale"
    # a method's default stated in the sweep's config is the same run; another value is not
    (job.run_dir / "config.yaml").write_text(dump_config(load_config(config, job.overrides)))
    config.write_text("name: x\ntrain: {rounds: 3, lr: 0.1}\nalgorithm: {name: fedprox, params: {mu: 0.01}}\n")
    (job.run_dir / "config.yaml").write_text(dump_config(load_config(config, job.overrides)).replace(
        "params:\n    mu: 0.01", "params: {}"))
    assert "params: {}" in (job.run_dir / "config.yaml").read_text()
    assert job_status(job) == "completed" and config_mismatch(job) == []
    config.write_text("name: x\ntrain: {rounds: 3, lr: 0.1}\nalgorithm: {name: fedprox, params: {mu: 0.1}}\n")
    assert config_mismatch(job) == ["algorithm.params: {} -> {'mu': 0.1}"]
    assert _parsed_yaml.cache_info().currsize <= 4096
