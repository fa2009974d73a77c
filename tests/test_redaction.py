"""Object-store secrets are redacted wherever they travel (issue 28, point 15): Spark's UI,
event log and plans, onceflow's logs and event log. Spark's default ``spark.redaction.regex``
(``secret|password|token|access[.]?key``) matches neither ``account_key`` nor
``connection_string``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

# values that Spark's default regex (it matches values too) does not catch by themselves
HADOOP_KEY = "hK7qZ2xW9mV4pL0aQ"   # spark.hadoop.fs.azure.account.key.<acct>...
ACCOUNT_KEY = "aK3rT8yU1iO5pQ7sW"  # storage_options account_key
CONN_KEY = "cK6dF2gH9jK4lZ8xE"     # AccountKey inside a connection string

SCRIPT = textwrap.dedent("""
    import json, logging, sys, urllib.request
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from onceflow.checkpoint.eventlog import EventLog
    from onceflow.spark import get_spark
    from onceflow.storage import configure
    work, hadoop_key, account_key, conn_key = sys.argv[1:5]
    import os; os.makedirs(work + "/spark-events")
    options = {{"account_name": "acct", "account_key": account_key,
                "connection_string": f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={{conn_key}};"}}
    configure(options)  # what Job(storage_options=...) does
    spark = get_spark("local[1]", "redaction", conf={{
        "spark.ui.enabled": "true", "spark.ui.port": "0",
        "spark.eventLog.enabled": "true", "spark.eventLog.dir": work + "/spark-events",
        "spark.eventLog.compress": "false",
        "spark.hadoop.fs.azure.account.key.acct.dfs.core.windows.net": hadoop_key}})
    q = (spark.readStream.format("onceflow-sequence").option("total", 10).load()
         .writeStream.format("onceflow-delta").option("path", work + "/table")
         .option("storage_options", json.dumps(options))
         .option("checkpointLocation", work + "/ckpt").trigger(availableNow=True).start())
    q.awaitTermination()
    seen = {{"explain": q._jsq.explainInternal(True), "progress": json.dumps(q.lastProgress, default=str)}}
    app, ui = spark.sparkContext.applicationId, spark.sparkContext.uiWebUrl
    for page in ("environment", "sql?details=true&planDescription=true"):
        seen[page] = urllib.request.urlopen(f"{{ui}}/api/v1/applications/{{app}}/{{page}}").read().decode()
    seen["conf"] = json.dumps([*spark.conf.getAll.items()]) if hasattr(spark.conf, "getAll") else ""
    logging.getLogger("onceflow.test").warning("the store said no to %s", options)
    EventLog(work + "/ckpt").append("failed", cause=f"cannot open abfs://c@acct: {{options}}")
    spark.stop()
    print(json.dumps(seen))
""")


def test_no_azure_secret_in_spark_ui_plans_event_logs_or_onceflow_logs(tmp_path):
    env = {**os.environ, "ONCEFLOW_SPARK_CONF": "{}"}  # the suite turns the UI off; this needs it
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(), str(tmp_path), HADOOP_KEY, ACCOUNT_KEY, CONN_KEY],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    spark_events = "".join(p.read_text() for p in (tmp_path / "spark-events").rglob("*") if p.is_file())
    onceflow_events = (tmp_path / "ckpt" / "_onceflow" / "events.jsonl").read_text()
    assert "spark.hadoop.fs.azure.account.key.acct" in seen["environment"]  # the page was read
    assert '"event": "failed"' in onceflow_events and "the store said no" in r.stderr
    places = {**seen, "spark event log": spark_events, "onceflow event log": onceflow_events,
              "driver log": r.stderr}
    leaks = [(where, secret) for where, text in places.items()
             for secret in (HADOOP_KEY, ACCOUNT_KEY, CONN_KEY) if secret in text]
    # spark.conf returns the settings as given (the user's own spark.hadoop.* key included);
    # what matters there is that onceflow never put its storage options into them
    assert not [leak for leak in leaks if leak != ("conf", HADOOP_KEY)], leaks


def test_redact_masks_every_store_secret_in_text_and_mappings():
    from onceflow.storage import redact

    text = ('{"account_key": "A1", "key": "AKIA", "secret": "S1", "session_token": "T1", '
            '"sas_token": "sv=1&sig=G1", "client_secret": "C1", "token": "/sa.json"} '
            "AccountKey=K1;SharedAccessSignature=sig9 AWS_SECRET_ACCESS_KEY=W1 "
            'value: "{\\"account_key\\": \\"E1\\"}" primary key: id')
    out = redact(text)
    for secret in ("A1", "AKIA", "S1", "T1", "G1", "C1", "sa.json", "K1", "sig9", "W1", "E1"):
        assert secret not in out, (secret, out)
    assert "primary key: id" in out and '"account_key": "***"' in out
    nested = redact({"client_kwargs": {"region_name": "eu"}, "AZURE_STORAGE_ACCOUNT_KEY": "Z",
                     "note": "AccountKey=K2;"})
    assert nested == {"client_kwargs": {"region_name": "eu"}, "AZURE_STORAGE_ACCOUNT_KEY": "***",
                      "note": "AccountKey=***;"}


def test_spark_redaction_conf_extends_what_the_user_gave():
    from onceflow.storage import SECRET_TEXT, spark_redaction_conf

    conf = spark_redaction_conf({"spark.redaction.regex": "(?i)mine"})
    assert conf["spark.redaction.regex"].startswith("(?:(?i)mine)|(?:(?i)secret|password|token")
    assert "account[._-]?key" in conf["spark.redaction.regex"]
    assert conf["spark.sql.redaction.string.regex"] == SECRET_TEXT
    assert "spark.redaction.regex" not in spark_redaction_conf({}, connect=True)


def test_pyiceberg_spellings_of_store_secrets_are_redacted_too():
    """An Iceberg ``catalog`` may carry pyiceberg's FileIO properties, hyphenated
    (``adls.account-key``, ``adls.connection-string``, ``s3.secret-access-key``): masked in
    text, in mappings, and matched by Spark's option regex (before: the hyphen slipped past
    ``account[._]?key`` and ``connection_string``)."""
    import re

    from onceflow.storage import SPARK_REDACTION, redact

    text = '{"adls.account-key": "AzK1", "adls.connection-string": "Cs1", "s3.secret-access-key": "S3k"}'
    out = redact(text)
    assert not any(s in out for s in ("AzK1", "Cs1", "S3k")), out
    assert redact({"adls.connection-string": "Cs1"}) == {"adls.connection-string": "***"}
    for name in ("adls.account-key", "adls.connection-string", "adls.sas-token"):
        assert re.search(SPARK_REDACTION, name), name
