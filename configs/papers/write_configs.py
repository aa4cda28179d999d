"""The write-or-check step shared by the papers' config generators (``*/generate.py``).

``write_configs(folder, files, check)`` writes each ``{file name: text}`` that is missing; a file
whose text differs is never overwritten (it may have been edited by hand) and is reported
instead, as is every missing or differing file with ``check``. Returns the exit status: 1 if
anything was reported.
"""

from __future__ import annotations

from pathlib import Path


def write_configs(folder: Path, files: dict[str, str], check: bool) -> int:
    reported = []
    for name, text in files.items():
        path = folder / name
        if path.exists() and path.read_text() == text:
            continue
        if check or path.exists():
            reported.append(f"{'differs' if path.exists() else 'missing'}: {name}")
            continue
        path.write_text(text)
    print("\n".join(reported) if reported else f"{len(files)} configs in {folder} are up to date")
    return 1 if reported else 0


def paper_section(source: str, cell: str, number: str, rule: str, metric: str | None = None,
                  percent: bool = True, measured_as: str = "final", rounds: int | None = None) -> str:
    """The config's ``paper:`` section (``fedhet compare`` prints it beside the measured numbers)
    from a table entry such as ``"64.08±0.41"`` (percent) or ``"0.9303"`` (``percent=False``);
    ``measured_as`` names the measured statistic that follows ``rule``, ``rounds`` the paper's T."""
    value, _, std = number.partition("±")
    scale = 100 if percent else 1

    def frac(text: str) -> str:
        return f"{float(text) / scale:.6g}"

    fields = [f"source: {_quote(source)}", f"cell: {_quote(cell)}"]
    if metric:
        fields.append(f"metric: {metric}")
    fields.append(f"value: {frac(value)}")
    if std:
        fields.append(f"std: {frac(std)}")
    fields.append(f"rule: {_quote(rule)}")
    if measured_as != "final":
        fields.append(f"measured_as: {_quote(measured_as)}")
    if rounds is not None:
        fields.append(f"rounds: {rounds}")
    return "paper:\n" + "".join(f"  {f}\n" for f in fields)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
