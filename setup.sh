#!/usr/bin/env bash
# Installs onceflow into ./.venv on a fresh machine.  Usage: ./setup.sh [test]
#   (no argument) runtime and the Delta sink (what `onceflow demo` needs);  test  every extra,
#   the test tools and the PostgreSQL server. Without setup.sh: pip install 'onceflow[EXTRAS]'.
set -euo pipefail
cd "$(dirname "$0")"
want_test=${1:-}

need_apt() {  # install Debian packages when we can (root + apt), else say how
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing $* with apt-get" >&2
    (apt-get install -y -q "$@" >/dev/null 2>&1) || (apt-get update -q >/dev/null && apt-get install -y -q "$@" >/dev/null)
  else
    echo "setup: missing $*; install it (Debian/Ubuntu: sudo apt-get install -y $*) and run ./setup.sh again" >&2
    exit 1
  fi
}

py=${PYTHON:-python3}
"$py" -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ needed"' \
  || { echo "setup: Python 3.11 or newer is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

java_ok() { command -v java >/dev/null && java -version 2>&1 | grep -Eq 'version "(1[7-9]|2[0-9])'; }
java_ok || need_apt openjdk-17-jre-headless
java_ok || { echo "setup: Java 17+ still not found on PATH; install it and retry" >&2; exit 1; }

if [ "$want_test" = test ]; then
  [ -x /usr/lib/postgresql/15/bin/initdb ] || need_apt postgresql-15
  # libfaketime: the lease tests run processes whose wall clocks are minutes off.
  command -v faketime >/dev/null || need_apt faketime
  # prometheus + promtool: tests/runtime/test_metrics.py scrapes a job and checks deploy/alerts.yml.
  command -v promtool >/dev/null || need_apt prometheus
  # PostgreSQL refuses to run as root: the test clusters run as the 'postgres' OS user.
  if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
    useradd --system --no-create-home --shell /usr/sbin/nologin postgres
  fi
fi

[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if [ "$want_test" = test ]; then
  .venv/bin/python -m pip install -q -e ".[test]"
else
  .venv/bin/python -m pip install -q -e ".[delta]"
fi
if [ "$want_test" = test ]; then
  # The Kinesis source tests run kinesalite (a Kinesis API server on Node.js) from .venv/node.
  if [ ! -f .venv/node/node_modules/kinesalite/cli.js ]; then
    { command -v node >/dev/null && command -v npm >/dev/null; } || need_apt nodejs npm
    echo "setup: installing kinesalite with npm into .venv/node" >&2
    npm install --silent --no-audit --no-fund --prefix .venv/node kinesalite >/dev/null \
      || { echo "setup: 'npm install kinesalite' failed (is the npm registry reachable?); fix and run ./setup.sh test again" >&2; exit 1; }
  fi
fi
# What every later start reuses, built now so that the first start is as fast as the second:
# the driver JVM's class archive (onceflow.jvm_cache; ONCEFLOW_JVM_CACHE=0 skips it).
if [ "${ONCEFLOW_JVM_CACHE:-1}" != 0 ]; then
  archive=$(.venv/bin/python -c 'from onceflow.jvm_cache import archive_path; print(archive_path())')
  if [ ! -f "$archive" ]; then
    echo "setup: building the driver JVM's class archive (about 30 s; faster driver starts)" >&2
    ONCEFLOW_JVM_CACHE=0 .venv/bin/python -m onceflow.runtime.jvm_archive "$archive" 2>/dev/null \
      || echo "setup: no class archive yet (the first driver builds it in the background)" >&2
  fi
fi
echo "setup: done (.venv ready)" >&2
