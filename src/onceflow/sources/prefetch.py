"""Reading ahead: a source task's next records are fetched while the current ones are converted."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


def prefetched(produce: Callable[[threading.Event], Iterator[T]], name: str, depth: int = 4) -> Iterator[T]:
    """The items of ``produce(done)``, fetched by a background thread at most ``depth`` ahead.

    The thread's errors are raised here, in order. When the consumer stops early (closes this
    generator), ``done`` is set: ``produce`` should stop at its next look at it; the thread is
    joined for up to 30 s."""
    chunks: queue.Queue = queue.Queue(maxsize=depth)
    done = threading.Event()

    def pump() -> None:
        try:
            for item in produce(done):
                while not done.is_set():
                    try:
                        chunks.put(item, timeout=0.5)
                        break
                    except queue.Full:
                        continue
            chunks.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the reading thread
            chunks.put(e)

    fetcher = threading.Thread(target=pump, name=name, daemon=True)
    fetcher.start()
    try:
        while (item := chunks.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        done.set()
        fetcher.join(timeout=30)
