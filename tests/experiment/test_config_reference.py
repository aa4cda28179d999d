"""configs/README.md is the key reference an unknown key's error sends users to: every key of the
schema (each section's fields, one level down) has its row there."""

from __future__ import annotations

import re
from pathlib import Path

from fedhet.experiment.config import ExperimentConfig

README = Path(__file__).resolve().parents[2] / "configs" / "README.md"


def schema_keys() -> list[str]:
    keys = []
    for section, field in ExperimentConfig.model_fields.items():
        fields = getattr(field.annotation, "model_fields", None)
        keys += [section] if fields is None else [f"{section}.{name}" for name in fields]
    return keys


def test_every_config_key_is_in_the_key_table():
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `")]
    documented = {m for row in rows for m in re.findall(r"`([a-z_]+(?:\.[a-z_]+)*)", row.split(" | ")[0])}
    keys = schema_keys()
    assert len(keys) > 50                                  # the walk reached every section's fields
    missing = [k for k in keys if not any(d == k or d.startswith(k + ".") for d in documented)]
    assert not missing, f"keys without a row in configs/README.md: {missing}"
