"""Copying files between filesystem URLs while computing SHA-256 in the same pass.

Both sides go through fsspec, so a checkpoint on one filesystem and a savepoint on another
work alike. Files are copied by a small thread pool: hashlib and file I/O release the GIL,
so large state files copy in parallel.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import fsspec

CHUNK = 8 * 1024 * 1024
WORKERS = 4


@dataclass(frozen=True)
class Copied:
    rel: str
    size: int
    sha256: str


def copy_hashed(src_fs: fsspec.AbstractFileSystem, src: str, dst_fs: fsspec.AbstractFileSystem, dst: str) -> tuple[int, str]:
    """Copy one file, returning (bytes copied, hex SHA-256 of what was read)."""
    h = hashlib.sha256()
    size = 0
    parent = dst.rsplit("/", 1)[0]
    if parent and parent != dst:
        dst_fs.makedirs(parent, exist_ok=True)
    with src_fs.open(src, "rb") as fin, dst_fs.open(dst, "wb") as fout:
        while chunk := fin.read(CHUNK):
            h.update(chunk)
            fout.write(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def sha256_of(fs: fsspec.AbstractFileSystem, path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def copy_tree(
    pairs: Iterable[tuple[str, str, str]],
    src_fs: fsspec.AbstractFileSystem,
    dst_fs: fsspec.AbstractFileSystem,
    check: Callable[[Copied], None] | None = None,
) -> list[Copied]:
    """Copy ``(rel, src, dst)`` triples in parallel; ``check`` may raise to abort the copy."""
    pairs = list(pairs)

    def one(item: tuple[str, str, str]) -> Copied:
        rel, src, dst = item
        size, digest = copy_hashed(src_fs, src, dst_fs, dst)
        copied = Copied(rel, size, digest)
        if check is not None:
            check(copied)
        return copied

    if len(pairs) <= 1:
        return [one(p) for p in pairs]
    with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="onceflow-copy") as pool:
        return list(pool.map(one, pairs))
