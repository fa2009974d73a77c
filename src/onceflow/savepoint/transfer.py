"""Copying files between filesystem URLs while computing SHA-256 in the same pass.

Both sides go through fsspec, so a checkpoint on one filesystem and a savepoint on another
work alike. Between two local paths the bytes are copied in the kernel (``shutil.copyfile``:
sendfile / copy_file_range, what a plain ``cp -r`` does) and hashed from a read-only mmap of
the source, without copying them through Python buffers; elsewhere they stream through
fsspec in 8 MiB chunks, hashed on the way. Files are handled by a thread pool: hashlib (for
buffers over 2 KiB) and the copy release the GIL, so hashing overlaps copying. Checkpoint files are written once and never modified, so hashing the source and
copying it are the same bytes.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import fsspec
from fsspec.implementations.local import LocalFileSystem

CHUNK = 8 * 1024 * 1024
WORKERS = min(8, 2 * (os.cpu_count() or 2))


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


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """One pool per process (threads are started once, not per savepoint)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="onceflow-copy")
        return _POOL


def _settle(futures: list[Future]) -> None:
    """Cancel what has not started and wait for the rest (nothing may write after a failure)."""
    for f in futures:
        f.cancel()
    wait(futures)


def copy_tree(
    pairs: Iterable[tuple[str, str, str]],
    src_fs: fsspec.AbstractFileSystem,
    dst_fs: fsspec.AbstractFileSystem,
    check: Callable[[Copied], None] | None = None,
) -> list[Copied]:
    """Copy ``(rel, src, dst)`` triples; ``check`` sees each file's size and SHA-256 and may
    raise to abort (every started copy has finished when the exception propagates).

    Local to local, each file's kernel copy and its hashing are separate tasks of a thread
    pool, so they overlap within a file and across files. Elsewhere each file streams through
    fsspec with its hash computed on the way, files in parallel."""
    pairs = list(pairs)
    if isinstance(src_fs, LocalFileSystem) and isinstance(dst_fs, LocalFileSystem):
        for parent in sorted({dst.rsplit("/", 1)[0] for _, _, dst in pairs}):
            os.makedirs(parent, exist_ok=True)
        pool = _pool()
        copies, hashes = [], []
        for _, src, dst in pairs:
            copies.append(pool.submit(shutil.copyfile, src, dst))
            hashes.append(pool.submit(_local_sha256, src))
        out = []
        try:
            for (rel, _, _), h in zip(pairs, hashes, strict=True):
                size, digest = h.result()
                copied = Copied(rel, size, digest)
                if check is not None:
                    check(copied)
                out.append(copied)
            for c in copies:
                c.result()
        except BaseException:
            _settle(copies + hashes)
            raise
        return out

    def one(item: tuple[str, str, str]) -> Copied:
        rel, src, dst = item
        size, digest = copy_hashed(src_fs, src, dst_fs, dst)
        copied = Copied(rel, size, digest)
        if check is not None:
            check(copied)
        return copied

    futures = [_pool().submit(one, p) for p in pairs]
    try:
        return [f.result() for f in futures]
    except BaseException:
        _settle(futures)
        raise
