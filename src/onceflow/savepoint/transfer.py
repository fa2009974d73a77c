"""Copying files between filesystem URLs while computing SHA-256 in the same pass.

Both sides go through fsspec, so a checkpoint on one filesystem and a savepoint on another
work alike. Between two local paths the bytes are copied in the kernel (``shutil.copyfile``:
sendfile / copy_file_range, what a plain ``cp -r`` does) and hashed from a read-only mmap of
the source, without copying them through Python buffers; elsewhere they stream through
fsspec in 8 MiB chunks, hashed on the way. Files are handled by a thread pool: hashlib (for
buffers over 2 KiB) and the copy release the GIL, so one file's hashing overlaps another's
copy. Checkpoint files are written once and never modified, so hashing the source and
copying it are the same bytes.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import fsspec
from fsspec.implementations.local import LocalFileSystem

CHUNK = 8 * 1024 * 1024
WORKERS = min(8, 2 * (os.cpu_count() or 2))
PARALLEL_MIN_BYTES = 4 * 1024 * 1024  # local copies go parallel only with 2+ files this large


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
    if isinstance(src_fs, LocalFileSystem) and isinstance(dst_fs, LocalFileSystem):
        if parent and parent != dst:
            os.makedirs(parent, exist_ok=True)
        size, digest = _local_sha256(src)
        shutil.copyfile(src, dst)
        return size, digest
    if parent and parent != dst:
        dst_fs.makedirs(parent, exist_ok=True)
    with src_fs.open(src, "rb") as fin, dst_fs.open(dst, "wb") as fout:
        while chunk := fin.read(CHUNK):
            h.update(chunk)
            fout.write(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _local_sha256(path: str) -> tuple[int, str]:
    """(size, SHA-256) of a local file, hashed from a read-only mmap (no Python-side copies)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                h.update(m)
    return size, h.hexdigest()


def sha256_of(fs: fsspec.AbstractFileSystem, path: str) -> tuple[int, str]:
    if isinstance(fs, LocalFileSystem):
        return _local_sha256(path)
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
    """Copy ``(rel, src, dst)`` triples, in parallel when there is enough data to make it pay
    (threads cost more than they save on a few small files); ``check`` may raise to abort."""
    pairs = list(pairs)
    parallel = len(pairs) > 1
    if parallel and isinstance(src_fs, LocalFileSystem):
        big = sum(1 for _, src, _ in pairs if os.path.getsize(src) >= PARALLEL_MIN_BYTES)
        parallel = big > 1

    def one(item: tuple[str, str, str]) -> Copied:
        rel, src, dst = item
        size, digest = copy_hashed(src_fs, src, dst_fs, dst)
        copied = Copied(rel, size, digest)
        if check is not None:
            check(copied)
        return copied

    if not parallel:
        return [one(p) for p in pairs]
    with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="onceflow-copy") as pool:
        return list(pool.map(one, pairs))
