"""A throwaway PostgreSQL 15 cluster for tests and benchmarks (initdb + pg_ctl, no Docker).

Runs as the unprivileged ``postgres`` OS user when we are root (PostgreSQL refuses root),
listens on a random free port on 127.0.0.1 only, and requires a password over TCP
(scram-sha-256) so tests exercise DSNs that carry secrets.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

PG_BIN = Path(os.environ.get("ONCEFLOW_PG_BIN", "/usr/lib/postgresql/15/bin"))
OS_USER = "postgres"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgCluster:
    """One cluster in a temp directory; ``dsn`` carries the superuser password."""

    def __init__(self, max_prepared_transactions: int = 20, fsync: bool = False, name: str = "pg"):
        if not (PG_BIN / "initdb").exists():
            raise RuntimeError(f"PostgreSQL binaries not found in {PG_BIN}; set ONCEFLOW_PG_BIN")
        self.root = Path(tempfile.mkdtemp(prefix=f"onceflow-{name}-"))
        self.data = self.root / "data"
        self.logfile = self.root / "server.log"
        self.port = _free_port()
        self.password = "pw-" + secrets.token_hex(8)
        self.dsn = f"postgresql://postgres:{self.password}@127.0.0.1:{self.port}/postgres"
        self._as_root = os.geteuid() == 0
        if self._as_root:
            user = pwd.getpwnam(OS_USER)
            os.chown(self.root, user.pw_uid, user.pw_gid)
        pwfile = self.root / "pwfile"
        pwfile.write_text(self.password + "\n")
        if self._as_root:
            os.chown(pwfile, user.pw_uid, user.pw_gid)
        self._run(
            "initdb", "-D", str(self.data), "-U", "postgres", "-E", "UTF8", "--no-sync",
            "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}",
        )
        pwfile.unlink()
        conf = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.root}'",
            "max_prepared_transactions": str(max_prepared_transactions),
            "max_connections": "60",
            "shared_buffers": "128MB",
            "fsync": "on" if fsync else "off",
            "synchronous_commit": "on" if fsync else "off",
            "full_page_writes": "on" if fsync else "off",
            "max_wal_size": "2GB",
            "log_min_messages": "warning",
        }
        with open(self.data / "postgresql.conf", "a") as f:
            f.writelines(f"{k} = {v}\n" for k, v in conf.items())
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        cmd = [str(PG_BIN / tool), *args]
        if self._as_root:
            cmd = ["runuser", "-u", OS_USER, "--", *cmd]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=self.root)
        if res.returncode != 0:
            log = self.logfile.read_text()[-2000:] if self.logfile.exists() else ""
            raise RuntimeError(f"{tool} {' '.join(args)} failed: {res.stderr or res.stdout}\n{log}")

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.logfile), "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self, fast: bool = True) -> None:
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.logfile), "-m",
            "fast" if fast else "smart", "-w", "-t", "60", "restart",
        )

    def is_running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def destroy(self) -> None:
        if self.is_running():
            try:
                self.stop("immediate")
            except RuntimeError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)
