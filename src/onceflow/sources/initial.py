"""A new query's initial positions, kept in the checkpoint so that a replayed batch 0 reads
what the first attempt read (shared by the replayable sources).

Spark asks a source for its initial offset again when batch 0 is replayed after a crash (its
end is in ``offsets/0``, its start is not). For relative starts (latest, a timestamp) a second
answer would differ, so the first one is kept in ``<checkpoint>/_onceflow/``, one file per
source configuration, as Spark's Kafka source keeps it in ``sources/0``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("onceflow.sources")


def kept_initial(saved: str | None, identity: str, compute: Callable[[], Any], name: str) -> Any:
    """The positions kept at ``saved`` for this source ``identity``, else ``compute()`` kept there.

    The file is replaced whole (:func:`onceflow.storage.write_whole`: never torn on an object
    store). An unreadable file (torn by a crash of an older version mid-write) counts as absent:
    Spark writes ``offsets/0`` only after the initial offset was returned, so no batch can have
    been planned from it. ``saved`` None (no checkpoint known): computed, not kept."""
    if saved is None:
        return compute()
    from onceflow.storage import url_to_fs, write_whole

    fs, path = url_to_fs(saved)
    try:
        with fs.open(path, "r") as f:
            kept = json.load(f)
        if isinstance(kept, dict) and kept.get("source") == identity:
            return kept["offsets"]
    except FileNotFoundError:
        pass
    except ValueError as e:
        log.warning("%s: %s is unreadable (%s); computing the initial positions again", name, saved, e)
    offsets = compute()
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    write_whole(fs, path, json.dumps({"source": identity, "offsets": offsets}).encode())
    return offsets
