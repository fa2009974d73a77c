"""DSN handling of the PostgreSQL sink: the password never leaves this module in clear.

Guarantees: :func:`split_dsn` separates the password from the rest of a DSN (libpq URL or
key=value string) and, when a DSN with a password cannot be parsed, withholds libpq's message
(it quotes fragments of the string). :func:`where`, :func:`mask_dsn` and :func:`scrub` give
text that is safe for errors and logs: the server as ``host:port/dbname``, the DSN with its
password replaced by ``***``, and any message with known secrets and password-looking parts
masked and folded onto one line.
"""

from __future__ import annotations

import re

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from onceflow.errors import ConfigError

FORMAT = "onceflow-postgres"


def split_dsn(dsn: str) -> tuple[str, str | None]:
    """(DSN without password as key=value conninfo, password or None). Accepts URL or key=value."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as e:
        if re.search(r"password|://[^/@]*:[^/@]*@", dsn, re.IGNORECASE):
            # libpq's message quotes fragments of the string, which may be pieces of the password
            raise ConfigError(
                f"{FORMAT}: cannot parse the DSN (details withheld: it contains a password); quote "
                "values with spaces or quotes, e.g. password='a b\\'c', or give the password as the "
                "'password' option"
            ) from None
        raise ConfigError(f"{FORMAT}: cannot parse the DSN ({str(e).strip()}); use a libpq URL or key=value string") from None
    password = params.pop("password", None)
    return make_conninfo(**{k: str(v) for k, v in params.items()}), password


def where(dsn: str) -> str:
    """``host:port/dbname`` for messages (never the password)."""
    params = conninfo_to_dict(split_dsn(dsn)[0])
    return f"{params.get('host', 'localhost')}:{params.get('port', 5432)}/{params.get('dbname', params.get('user', ''))}"


def mask_dsn(dsn: str) -> str:
    """The DSN with its password replaced by ``***``."""
    safe, password = split_dsn(dsn)
    return make_conninfo(safe, password="***") if password else safe


def scrub(text: str, *secrets: str | None) -> str:
    """``text`` on one line, with ``secrets`` and anything that looks like a password masked."""
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    text = re.sub(r"(password\s*=\s*|://[^:/@\s]+:)[^@\s]+(@?)", r"\1***\2", text)
    return " ".join(text.split())
