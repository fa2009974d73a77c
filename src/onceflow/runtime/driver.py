"""The supervised driver process: ``python -m onceflow.runtime.driver path/to/job.py[:name]``.

Exit codes (read by the supervisor): 0 finished or stopped on request; 2 configuration or
user error (do not restart); 3 the in-process restart strategy gave up (do not restart);
anything else, or death by a signal, is a crash (restart per strategy).
SIGTERM/SIGINT stop gracefully: the in-flight batch finishes (or is rolled back), then exit 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from onceflow.errors import OnceflowError

EXIT_OK, EXIT_CONFIG, EXIT_GAVE_UP = 0, 2, 3


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
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
