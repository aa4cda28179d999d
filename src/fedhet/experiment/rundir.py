"""The run directory: every file a run writes, written so that a crash loses nothing recorded.

  config.yaml      the resolved config (every default filled in; algorithm.params as given)
  metrics.jsonl    one line per round, appended, flushed and fsynced as it happens
  checkpoint.pt    server + client state every ``run.checkpoint_every`` rounds (atomic replace)
  summary.json     best/final values with the rule that chose them, the method's parameters with
                   their defaults, speed, memory, communication
  accuracy.png     the accuracy curves
  partition.json   per-client train/test label counts
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedhet.core.errors import CheckpointError, ConfigError, OutputError

CHECKPOINT = "checkpoint.pt"
CHECKSUM = "checkpoint.sha256"        # the checkpoint's digest, written with it (RunDir.save_checkpoint)
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CONFIG = "config.yaml"
PARTITION = "partition.json"
# A row's evaluation made only because its round was the last of a run since extended (set_aside_evaluation)
EVALUATED_AS_LAST = "evaluated_as_last_round"
LOCK = ".lock"          # held (flock) by the process writing the run; the kernel frees it when that process dies


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of ``run_dir``'s metrics.jsonl up to the first line that is not the next round's
    record: a line cut off by a kill, bytes that are not UTF-8 or not JSON, JSON that is not a
    mapping with a whole-number ``round``, or a round not after the one before (a run writes 1, 2,
    3, ...): a damaged file (:func:`first_damaged_line` says where). Every row before it
    is intact and returned; a resume then refuses a file that lacks rounds its checkpoint has done.
    A RuntimeWarning names a damaged line that has rows after it (left unread); the last line cut
    off by a kill, the common case, passes without one."""
    path = Path(run_dir) / METRICS
    rows, damaged = _read_rows(path)
    if damaged is not None and (later := _rows_after(path, damaged)):
        warnings.warn(f"{path}: line {damaged} is damaged (not the next round's record), so its {later} later "
                      f"line(s) are not read; the rows before it are (rounds up to "
                      f"{rows[-1]['round'] if rows else 'none'})", RuntimeWarning, stacklevel=2)
    return rows


def first_damaged_line(run_dir: str | Path) -> int | None:
    """The number (from 1) of the line of metrics.jsonl where :func:`read_metrics` stopped, or None."""
    return _read_rows(Path(run_dir) / METRICS)[1]


def _rows_after(path: Path, number: int) -> int:
    """How many non-empty lines of ``path`` follow its line ``number``."""
    return sum(1 for raw in path.read_bytes().splitlines()[number:] if raw.strip())


def _read_rows(path: Path) -> tuple[list[dict], int | None]:
    rows: list[dict] = []
    if not path.is_file():
        return rows, None
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return rows, number
        if (not isinstance(row, dict) or type(row.get("round")) is not int
                or row["round"] <= (rows[-1]["round"] if rows else 0)):
            return rows, number
        rows.append(row)
    return rows, None


def checked_run_dir(path: str | Path, *, resume: bool = False, option: str | None = None) -> Path:
    """``path`` as a run directory to create (``--out``) or, with ``resume``, to continue
    (``--resume``); a ConfigError when it is empty (an empty string would be the current folder)
    or a file, and for a resume a CheckpointError when it does not exist or holds no run."""
    option = option or ("--resume" if resume else "--out")
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{option} {path!r} is of type {type(path).__name__}: name the run directory as a path, e.g. "
                          "'runs/try'")
    if not str(path).strip():
        raise ConfigError(f"{option} is empty: name the run directory" + (
            " (the folder holding its config.yaml)" if resume else
            ", e.g. --out runs/try (out='runs/try' from Python), or leave it out for run.out_dir/<name>-s<seed>-<time>"))
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{option} {p} is a file, not a run directory: " + (
            "name the folder of the run (the one holding config.yaml)" if resume else
            "name a folder (a new path, or an existing folder that holds no run)"))
    if resume and not p.exists():
        raise CheckpointError(f"{option} {p} does not exist: name the folder of the run (the one holding its "
                              "config.yaml)")
    if resume and not (p / CONFIG).is_file():
        raise CheckpointError(f"{p} is not a fedhet run directory (no {CONFIG})")
    return p


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock_fd: int | None = None       # the open .lock while this process holds the folder

    def holds_run(self) -> bool:
        """Whether any of a run's own files is here (one lost from a run folder still marks it)."""
        return any((self.path / name).exists() for name in (METRICS, CONFIG, SUMMARY, CHECKPOINT))

    def lock(self) -> None:
        """Hold the run directory for this process until :meth:`unlock` (or the process's end):
        a second process writing the same folder would interleave its metrics with this one's."""
        import fcntl

        if self._lock_fd is not None:
            return
        self.create()
        path = self.path / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"cannot write {path}: {e.strerror or e}; choose another --out") from None
        for attempt in range(5):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt < 4:         # a reader's look (held_by) holds it for a moment only
                    time.sleep(0.02)
        else:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"{self.path} is in use by another fedhet process (pid {holder}); two runs cannot "
                              "share a run directory: wait for that one to end, or choose another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def held_by(self) -> str | None:
        """The pid (as written) of the process writing this run now, or None when none is: a run
        going on holds the lock; a finished, failed or killed one does not (the kernel frees it)."""
        import fcntl

        try:
            fd = os.open(self.path / LOCK, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)
        return None

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None            # closing the descriptor releases the flock

    def create(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create the run directory {self.path}: {e.strerror or e}; choose another "
                              f"--out (or run.out_dir)") from None

    def write_text(self, name: str, text: str) -> None:
        """Atomically: a reader never sees half a file."""
        self._atomic(name, lambda tmp: tmp.write_text(text))

    def _atomic(self, name: str, write: Callable[[Path], object]) -> None:
        tmp = self.path / (name + ".tmp")
        try:
            write(tmp)
            os.replace(tmp, self.path / name)
        except (OSError, RuntimeError) as e:      # torch.save reports a short write as RuntimeError
            tmp.unlink(missing_ok=True)
            raise self._cannot_write(name, e) from None

    def _cannot_write(self, name: str, e: BaseException) -> OutputError:
        reason = getattr(e, "strerror", None) or (
            "the file could not be written completely (disk full or a file-size limit?)"
            if isinstance(e, RuntimeError) else str(e).splitlines()[0])
        return OutputError(f"cannot write {self.path / name}: {reason}. Free space on (or permissions of) the file "
                           f"system of {self.path}, then continue with `fedhet run --resume {self.path}`; every "
                           f"round recorded in {METRICS} is kept.")

    def write_json(self, name: str, obj: Any) -> None:
        self.write_text(name, json.dumps(obj, indent=2))

    # --- metrics ------------------------------------------------------------------------
    def read_metrics(self) -> list[dict]:
        return read_metrics(self.path)

    def append_metrics(self, row: dict) -> None:
        try:
            with open(self.path / METRICS, "a") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:              # a cut line is dropped by read_metrics; the rows before it stay
            raise self._cannot_write(METRICS, e) from None

    def truncate_metrics(self, done_rounds: int) -> None:
        """Drop metric lines of rounds after the checkpoint: they will be recomputed identically."""
        self._write_rows([row for row in self.read_metrics() if row["round"] <= done_rounds])

    def _write_rows(self, rows: list[dict]) -> None:
        self.write_text(METRICS, "".join(json.dumps(row) + "\n" for row in rows))

    def set_aside_evaluation(self, rnd: int, is_evaluation: Callable[[str], bool]) -> bool:
        """Move round ``rnd``'s evaluated metrics (the keys ``is_evaluation`` names) into the row's
        :data:`EVALUATED_AS_LAST` mapping, kept but read by no summary, table or plot: a run extended
        past its last round evaluates on the schedule of the longer run, which evaluates no such
        round. Whether a row changed."""
        rows = self.read_metrics()
        changed = False
        for row in rows:
            if row["round"] == rnd and (moved := {k: row.pop(k) for k in list(row) if is_evaluation(k)}):
                row[EVALUATED_AS_LAST] = moved
                changed = True
        if changed:
            self._write_rows(rows)
        return changed

    # --- checkpoints --------------------------------------------------------------------
    def save_checkpoint(self, obj: Any) -> None:
        """``checkpoint.pt`` with its sha256 in ``checkpoint.sha256``, so that a file damaged later
        (a bad disk, a partial copy) is refused instead of resumed from. The digest file lists the
        new digest beside the old one while the checkpoint is being replaced: a process killed in
        between leaves a pair that still checks."""
        import torch  # here, not at the top: reading runs (sweep tables, compare) needs no torch

        tmp = self.path / (CHECKPOINT + ".tmp")
        try:
            torch.save(obj, tmp)
            new = _sha256(tmp)
            old = self._recorded_digests()       # all of them: one matches the file on disk, even after a kill
            self.write_text(CHECKSUM, "\n".join([new, *old]) + "\n")
            os.replace(tmp, self.path / CHECKPOINT)
            self.write_text(CHECKSUM, new + "\n")
        except (OSError, RuntimeError) as e:
            tmp.unlink(missing_ok=True)
            raise self._cannot_write(CHECKPOINT, e) from None

    def _recorded_digests(self) -> list[str]:
        try:
            return (self.path / CHECKSUM).read_text().split()
        except OSError:
            return []

    def load_checkpoint(self) -> dict | None:
        """The checkpoint's content; None where the run never wrote one (it then starts from round 1)."""
        ckpt = self.path / CHECKPOINT
        recorded = self._recorded_digests()
        has_digest = any(re.fullmatch(r"[0-9a-f]{64}", d) for d in recorded)
        if not ckpt.exists():
            if has_digest:
                # a digest without its file: the checkpoint was written and is gone since
                raise CheckpointError(f"checkpoint {ckpt} is missing, although {self.path / CHECKSUM} records that "
                                      f"one was written. Restarted, the run would replace its recorded rounds in "
                                      f"{self.path / METRICS}; restore the checkpoint from a copy, or delete "
                                      f"{self.path / CHECKSUM} to restart the run from round 1.")
            return None
        if recorded and not has_digest:
            raise CheckpointError(f"{self.path / CHECKSUM} is damaged: it holds no sha256 digest, so checkpoint {ckpt} "
                                  "cannot be checked against it (the checkpoint itself may be intact). Nothing was "
                                  f"changed; to resume from the checkpoint unchecked, delete {self.path / CHECKSUM}.")
        if not recorded:            # deleted (the fix its errors name), or a run from before the digest
            warnings.warn(f"checkpoint {ckpt} has no recorded sha256 ({self.path / CHECKSUM} is missing): it is read "
                          "unchecked", UserWarning, stacklevel=2)
        elif _sha256(ckpt) not in recorded:
            raise CheckpointError(f"checkpoint {ckpt} is damaged: its content no longer matches the sha256 recorded "
                                  f"when it was written ({self.path / CHECKSUM}). The recorded metrics in "
                                  f"{self.path / METRICS} are intact; restore the checkpoint from a copy, or delete "
                                  "it to restart the run from round 1.")
        import torch

        try:
            return torch.load(ckpt, weights_only=False, map_location="cpu")
        except Exception as e:  # a truncated or foreign file: say so, keep the metrics
            raise CheckpointError(f"cannot read checkpoint {ckpt}: {e}. The recorded metrics in "
                                  f"{self.path / METRICS} are intact; delete the checkpoint to restart the run "
                                  f"from round 1.") from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
