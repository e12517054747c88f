"""`trainwell data-service`: a local dispatcher and workers that serve a distributed dataset, then stop."""

import re
import threading
import time

import tensorflow as tf

from trainwell import cli
from trainwell.data.service import distribute


def test_cli_starts_a_service_that_serves_each_example_once_then_stops(capsys):
    result = {}
    thread = threading.Thread(target=lambda: result.update(rc=cli.main(
        ["data-service", "--workers", "2", "--seconds", "4"])))
    thread.start()
    out, deadline = "", time.monotonic() + 60
    while "dispatcher grpc://" not in out and time.monotonic() < deadline:
        time.sleep(0.1)
        out += capsys.readouterr().out
    target = re.search(r"dispatcher (grpc://127\.0\.0\.1:\d+), 2 worker\(s\)", out).group(1)
    assert f"--set data_service={target}" in out
    assert sorted(int(x) for x in distribute(tf.data.Dataset.range(12), target)) == list(range(12))
    thread.join(60)
    assert result["rc"] == 0 and "tf.data service stopped" in capsys.readouterr().out


def test_cli_refuses_bad_workers_and_port_in_one_line(capsys):
    assert cli.main(["data-service", "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainwell: error:") and "Received: workers=0" in err and "\n" not in err
    assert cli.main(["data-service", "--port", "70000"]) == 2
    assert "Received: port=70000" in capsys.readouterr().err
