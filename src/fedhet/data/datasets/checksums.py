"""Reading a data file's content and checking it against its official md5 (and a whole file's md5).

Files with a known official checksum are md5-verified (for ``.gz`` files the md5 of the
decompressed content, so a recompressed archive still verifies).  Results are cached by path,
size and mtime in ``~/.cache/fedhet/verified-md5.json`` (and in memory when that is not
writable), so repeated loads do not re-hash.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
import zlib
from pathlib import Path

from fedhet.core.errors import DataError
from fedhet.data.datasets.catalogue import _how_to_get

# md5 of the file content (decompressed content for .gz), keyed by file name without ".gz".
# Only official values we are sure of; files not listed here are loaded unverified.
_CHECKSUMS: dict[str, dict[str, str]] = {
    "fashion_mnist": {
        "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
        "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
        "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
        "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
    },
    "cifar10": {
        "data_batch_1": "c99cafc152244af753f735de768cd75f",
        "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
        "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
        "data_batch_4": "634d18415352ddfa80567beed471001a",
        "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
        "test_batch": "40351d587109b95175f43aff81a1287e",
    },
    "cifar100": {
        "train": "16019d7e3df5f24257cddd939b257f8d",
        "test": "f0ef6b0ae62326f3e7ffdfab6717acfc",
    },
}


def _md5_cache_file() -> Path:
    return Path.home() / ".cache" / "fedhet" / "verified-md5.json"


# path -> (size, mtime_ns, md5); used when the cache file cannot be written.
_MD5_MEMO: dict[str, tuple[int, int, str]] = {}


def _cached_md5(key: str, stat: os.stat_result) -> str | None:
    memo = _MD5_MEMO.get(key)
    if memo is not None and memo[:2] == (stat.st_size, stat.st_mtime_ns):
        return memo[2]
    try:
        entry = json.loads(_md5_cache_file().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(entry, dict) and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
        md5 = entry.get("md5")
        return md5 if isinstance(md5, str) else None
    return None


def _remember_md5(key: str, stat: os.stat_result, md5: str) -> None:
    _MD5_MEMO[key] = (stat.st_size, stat.st_mtime_ns, md5)
    cache = _md5_cache_file()
    try:
        try:
            entries = json.loads(cache.read_text())
            if not isinstance(entries, dict):
                entries = {}
        except (OSError, ValueError):
            entries = {}
        entries[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "md5": md5}
        cache.parent.mkdir(parents=True, exist_ok=True)
        # Write-then-rename so concurrent runs never read a half-written file.
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".verified-md5-")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, cache)
    except OSError:
        pass  # read-only home: the in-process memo still avoids re-hashing


def _verify_md5(name: str, path: Path, content: bytes) -> None:
    """Check ``content`` (the file's decompressed bytes) against the known md5 of ``path``."""
    expected = _CHECKSUMS.get(name, {}).get(path.name.removesuffix(".gz"))
    if expected is None:
        return
    stat = path.stat()
    key = str(path.resolve())
    actual = _cached_md5(key, stat)
    if actual is None:
        actual = hashlib.md5(content, usedforsecurity=False).hexdigest()
        _remember_md5(key, stat, actual)
    if actual != expected:
        what = "decompressed content of " if path.suffix == ".gz" else ""
        raise DataError(
            f"checksum mismatch for {path}: md5 of the {what}file is {actual}, expected {expected}. "
            f"The file is corrupt or a different version of {name}; delete it and obtain it again "
            f"({_how_to_get(name)}). Set FEDHET_SKIP_CHECKSUM=1 to skip verification."
        )


def _read_content(path: Path) -> bytes:
    """Read a file, transparently decompressing ``.gz``."""
    try:
        raw = path.read_bytes()
        return gzip.decompress(raw) if path.suffix == ".gz" else raw
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"cannot read {path}: {exc} (the file is truncated or corrupt)") from exc


def _file_md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
