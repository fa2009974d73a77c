"""Starting a job: the one way in, for ``onceflow run`` and for ``Job.run()``.

Both take the same steps, in this order, here and nowhere else:

1. resolve the checkpoint (the job's, or ``--checkpoint``) once, into a
   :class:`~onceflow.checkpoint.layout.CheckpointDir` that is handed down;
2. check it: creatable, writable, and its ``metadata`` readable when present (``onceflow run``:
   one line now, not a traceback later; in-process the runner checks it before its lease,
   waiting out a full disk). A restore skips this: it checks its empty target itself;
3. prepare the restore (``--from-savepoint``): every refusal a restore can make, before
   anything is written;
4. apply the overrides (checkpoint, restart strategy, master, remote) to the job;
5. start: the :class:`~onceflow.runtime.supervisor.Supervisor` (``onceflow run``: driver
   processes, each of which takes these steps again in-process with its own SparkSession),
   or the :class:`~onceflow.runtime.runner.JobRunner` in this process (``Job.run()``).

A restore that is refused after the run created its (absent) checkpoint directory removes it
again. Options travel from ``onceflow run`` to its drivers as environment variables
(:func:`driver_env` writes them, :func:`apply_overrides` reads them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from onceflow import logs
from onceflow.checkpoint.layout import CheckpointDir
from onceflow.errors import EXIT_CONFIG, ConfigError, OnceflowError
from onceflow.runtime.loader import load_job
from onceflow.runtime.metrics import PORT_ENV as METRICS_PORT_ENV
from onceflow.runtime.restart import parse
from onceflow.runtime.runner import JobRunner, check_checkpoint_dir
from onceflow.runtime.spec import JobSpec
from onceflow.runtime.supervisor import Supervisor
from onceflow.savepoint.manifest import SavepointError
from onceflow.savepoint.operations import SAVEPOINT_DIR_ENV, SAVEPOINT_ON_STOP_ENV
from onceflow.savepoint.restore import (
    RestoreRequest,
    remove_if_only_onceflow,
    restore_env,
    restore_options_from_env,
)
from onceflow.spark import REMOTE_ENV, SPARK_CONF_ENV, cli_conf

log = logging.getLogger("onceflow.launch")

# ``onceflow run`` -> its drivers
CHECKPOINT_ENV = "ONCEFLOW_CHECKPOINT"
RESTART_STRATEGY_ENV = "ONCEFLOW_RESTART_STRATEGY"
MASTER_ENV = "ONCEFLOW_MASTER"
LEASE_WAIT_ENV = "ONCEFLOW_LEASE_WAIT_S"


@dataclass
class LaunchOptions:
    """The options of ``onceflow run`` (each None / default: the job's own setting)."""

    checkpoint: str | None = None
    restart_strategy: str | None = None  #: a spec, e.g. ``fixed_delay:attempts=5,delay=2s``
    from_savepoint: str | None = None
    fork: bool = False
    rescale: int | None = None
    allow_non_restored_state: bool = False
    savepoint_dir: str | None = None
    savepoint_on_stop: bool = True
    master: str | None = None
    remote: str | None = None
    conf: dict[str, str] = field(default_factory=dict)
    metrics_port: int | None = None
    standby: bool = True
    wait_for_lease: float = math.inf  #: stand by while another driver holds the lease (0: exit 5)
    args: tuple[str, ...] = ()  #: the job's own arguments: its ``sys.argv[1:]`` in every process

    def check(self) -> None:
        """ConfigError for options that contradict each other (nothing is read or written)."""
        if self.master and self.remote:
            raise ConfigError("--master and --remote contradict each other: a Spark Connect "
                              "server has its own master; give one")
        if self.remote and not self.remote.startswith("sc://"):
            raise ConfigError(f"--remote {self.remote!r}: give a Spark Connect URL, e.g. sc://host:15002")
        if self.savepoint_dir and not self.savepoint_on_stop:
            raise ConfigError("--savepoint-dir and --no-savepoint-on-stop contradict each other; give one")
        restore_request(self.from_savepoint, self.fork, self.rescale, self.allow_non_restored_state)
        if self.restart_strategy:
            parse(self.restart_strategy)


def restore_request(from_savepoint: str | None, fork: bool = False, rescale: int | None = None,
                    allow_non_restored_state: bool = False) -> RestoreRequest | None:
    """The restore asked for, or None; SavepointError for restore flags without a savepoint."""
    if not from_savepoint:
        if fork or rescale is not None or allow_non_restored_state:
            raise SavepointError("--fork, --rescale and --allow-non-restored-state need --from-savepoint SP")
        return None
    return RestoreRequest(from_savepoint, fork, rescale, allow_non_restored_state)


def apply_overrides(job: JobSpec, environ: Mapping[str, str] | None = None) -> JobSpec:
    """Step 4: apply the ``onceflow run`` overrides found in ``environ`` to ``job``."""
    environ = os.environ if environ is None else environ
    if environ.get(CHECKPOINT_ENV):
        job.checkpoint = dataclasses.replace(job.checkpoint, directory=environ[CHECKPOINT_ENV])
    if environ.get(RESTART_STRATEGY_ENV):
        job.restart_strategy = parse(environ[RESTART_STRATEGY_ENV])
    if environ.get(MASTER_ENV):
        job.master = environ[MASTER_ENV]
    if environ.get(REMOTE_ENV):
        job.remote = environ[REMOTE_ENV]
    return job


def _prepare(job: JobSpec, restore: RestoreRequest | None, *, checkpoint: str | None = None,
             spark: Any = None, check: bool = True) -> tuple[CheckpointDir, bool]:
    """Steps 1-3: (the resolved checkpoint, whether its directory was absent)."""
    ckpt = CheckpointDir(checkpoint or job.checkpoint.directory)
    absent = not ckpt.fs.exists(ckpt.path)
    if restore is not None:
        restore.check(ckpt.url, job=job, spark=spark)
    elif check:
        check_checkpoint_dir(ckpt)
    return ckpt, absent


def run_in_process(job: JobSpec, spark: Any = None, stop: threading.Event | None = None, *,
                   restore: RestoreRequest | None = None, takeover: bool | int = False) -> bool:
    """``Job.run()``: steps 1-5 in this process; blocks until done, stopped or out of restarts.
    False when it never ran: stopped while standing by for another driver's lease."""
    ckpt, absent = _prepare(job, restore, spark=spark, check=False)  # the runner checks it
    runner = JobRunner(job, spark=spark, stop=stop, restore=restore, takeover=takeover, checkpoint=ckpt)
    try:
        runner.run()
        return runner.ran
    except OnceflowError:
        if restore is not None and absent:  # e.g. a checksum mismatch found while copying
            remove_if_only_onceflow(ckpt.url)
        raise


def restore_from_env(environ: Mapping[str, str] | None = None) -> RestoreRequest | None:
    """The restore ``onceflow run`` handed its driver (see :func:`driver_env`), or None."""
    opts = restore_options_from_env(os.environ if environ is None else environ)
    return restore_request(**opts) if opts else None


def driver_env(options: LaunchOptions, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of ``onceflow run``'s drivers: ``environ`` plus its options."""
    env = dict(environ)
    env.update(restore_env(options.from_savepoint, options.fork, options.rescale,
                           options.allow_non_restored_state))
    if options.restart_strategy:
        env[RESTART_STRATEGY_ENV] = parse(options.restart_strategy).describe()
    if options.checkpoint:
        env[CHECKPOINT_ENV] = options.checkpoint
    env[SAVEPOINT_ON_STOP_ENV] = "1" if options.savepoint_on_stop else "0"
    if options.master:
        env[MASTER_ENV] = options.master
    if options.remote:
        env[REMOTE_ENV] = options.remote
    if options.metrics_port:
        env[METRICS_PORT_ENV] = str(options.metrics_port)
    if options.conf:
        env[SPARK_CONF_ENV] = json.dumps({**cli_conf(), **options.conf})
    if options.wait_for_lease:
        env[LEASE_WAIT_ENV] = str(options.wait_for_lease)
    if options.savepoint_dir:
        sp_dir = options.savepoint_dir
        env[SAVEPOINT_DIR_ENV] = sp_dir if "://" in sp_dir else os.path.abspath(sp_dir)
    return env


def driver_args(args: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The driver command's arguments after TARGET: ``-- ARGS`` for the job (none: nothing)."""
    return ("--", *args) if args else ()


def split_driver_argv(argv: list[str]) -> tuple[str, list[str]] | None:
    """(TARGET, job args) of ``TARGET [-- ARGS...]``; None when malformed."""
    if len(argv) == 1:
        return argv[0], []
    if len(argv) >= 2 and argv[1] == "--":
        return argv[0], argv[2:]
    return None


def launch(target: str, options: LaunchOptions | None = None,
           environ: Mapping[str, str] | None = None) -> int:
    """``onceflow run TARGET``: steps 1-5 with the supervisor; returns the exit code.

    OnceflowError (exit 2 for the caller) for bad options, an unusable checkpoint or a refused
    restore, before any driver starts."""
    options = options or LaunchOptions()
    options.check()
    job = load_job(target, options.args)
    logs.set_job(job.name)
    restore = restore_request(options.from_savepoint, options.fork, options.rescale,
                              options.allow_non_restored_state)
    ckpt, absent = _prepare(job, restore, checkpoint=options.checkpoint)
    env = driver_env(options, os.environ if environ is None else environ)
    apply_overrides(job, env)
    rc = Supervisor(target, job.restart_strategy, ckpt, driver_args(options.args), env=env,
                    standby=options.standby).run()
    if restore is not None and rc == EXIT_CONFIG and absent and remove_if_only_onceflow(ckpt.url):
        log.info("the restore was refused; removed %s, which this run had created", ckpt.url)
    return rc
