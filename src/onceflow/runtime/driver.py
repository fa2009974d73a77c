"""The supervised driver process: ``python -m onceflow.runtime.driver path/to/job.py[:name]``.

Exit codes (read by the supervisor): 0 finished or stopped on request; 2 configuration or
user error (do not restart); 3 the in-process restart strategy gave up (do not restart);
4 stopped on request but the savepoint could not be taken; anything else, or death by a
signal, is a crash (restart per strategy).

SIGTERM/SIGINT stop with a savepoint (DESIGN.md section 7): the in-flight batch finishes (or,
if it was only planned, is left to be replayed), the query stops, the lease is released,
then a savepoint of the last committed batch is taken (see
:func:`onceflow.savepoint.operations.savepoint_on_stop` for where it goes and how
``onceflow stop`` / ``onceflow run --no-savepoint-on-stop`` change that); its path is printed
and logged as a ``savepoint`` event with ``reason="stop"``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from onceflow.errors import OnceflowError

EXIT_OK, EXIT_CONFIG, EXIT_GAVE_UP, EXIT_SAVEPOINT_FAILED = 0, 2, 3, 4


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m onceflow.runtime.driver path/to/job.py[:name]", file=sys.stderr)
        return EXIT_CONFIG
    logging.basicConfig(level=logging.INFO, format="%(asctime)s driver %(levelname)s %(message)s")
    from onceflow.runtime.loader import load_job
    from onceflow.runtime.runner import GaveUp
    from onceflow.runtime.supervisor import apply_overrides

    stop = threading.Event()

    def _on_signal(signum, _frame):
        logging.getLogger("onceflow.driver").info(
            "%s received: stopping after the in-flight batch", signal.Signals(signum).name
        )
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    started = time.time()
    try:
        from onceflow.savepoint.restore import restore_options_from_env

        job = apply_overrides(load_job(argv[0]))
        job.run(stop=stop, **restore_options_from_env(os.environ))
    except GaveUp as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_GAVE_UP
    except OnceflowError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if stop.is_set():
        return _savepoint_on_stop(job.checkpoint.directory, job.name, started)
    return EXIT_OK


def _savepoint_on_stop(checkpoint_url: str, job_name: str, started: float) -> int:
    from onceflow.savepoint.operations import savepoint_on_stop

    try:
        taken = savepoint_on_stop(checkpoint_url, job_name, started)
    except Exception as e:  # noqa: BLE001 - any failure: the stop did not do what was asked
        print(f"error: stopped, but the savepoint on stop failed: {e}; the checkpoint "
              f"{checkpoint_url} is intact: take one with 'onceflow savepoint create "
              f"{checkpoint_url}'", file=sys.stderr)
        return EXIT_SAVEPOINT_FAILED
    if taken:
        url, m = taken
        logging.getLogger("onceflow.driver").info("savepoint on stop: %s (batch %d)", url, m.batch)
        print(f"savepoint {url}: job {m.job}, batch {m.batch}, {len(m.files)} files", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
