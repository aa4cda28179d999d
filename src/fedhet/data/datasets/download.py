"""``download=True``: fetching a dataset's official files into the first writable search directory.

The sources (mirrors and md5 of each file) are in :data:`~fedhet.data.datasets.catalogue._DOWNLOADS`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.request
from pathlib import Path

from fedhet.core.errors import DataError
from fedhet.data.datasets import catalogue
from fedhet.data.datasets.catalogue import _DOWNLOADS, _HOW_TO_GET, data_search_dirs
from fedhet.data.datasets.checksums import _file_md5

_DOWNLOAD_TIMEOUT_S = 30


def _download(name: str, root: str | os.PathLike | None) -> Path:
    """Download ``name``'s official files into the first writable directory; return it."""
    mirrors, files = _DOWNLOADS[name]
    # _SYSTEM_DIRS is read through its module, not imported by name, so that replacing it (as the
    # tests do) reaches this check as well as data_search_dirs.
    candidates = [d for d in data_search_dirs(name, root) if d != catalogue._SYSTEM_DIRS.get(name)]
    if root is not None:
        candidates.remove(Path(root).expanduser())  # never scatter files directly into root
    target = None
    for d in candidates:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            target = d
            break
    if target is None:
        raise DataError(f"cannot download {name}: none of {', '.join(map(str, candidates))} is writable")
    for fname, md5 in files:
        dest = target / fname
        if dest.is_file() and _file_md5(dest) == md5:
            continue
        failures = []
        for base in mirrors:
            try:
                _fetch(base + fname, dest, md5)
                break
            except (OSError, ValueError) as exc:  # URLError, timeouts and HTTP errors are OSErrors
                failures.append(f"  {base}{fname}: {exc}")
        else:
            raise DataError(
                f"could not download {name} (is a network connection available?):\n" + "\n".join(failures) + "\n"
                f"Get the files manually: {_HOW_TO_GET[name]}; "
                f"for example into {target}."
            )
    return target

def _fetch(url: str, dest: Path, md5: str) -> None:
    """Stream ``url`` to ``dest`` via a temporary file, keeping it only if its md5 matches."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        digest = hashlib.md5(usedforsecurity=False)
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=_DOWNLOAD_TIMEOUT_S) as response:
            for chunk in iter(lambda: response.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != md5:
            raise ValueError(f"downloaded file has md5 {digest.hexdigest()}, expected {md5}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
