"""The load test in docs/benchmarks/bench_server.py, run small enough for CI: 200 requests
from 16 concurrent clients against the tiny artifact, loopback only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "docs" / "benchmarks" / "bench_server.py"


def test_200_requests_from_16_clients(tiny_artifact):
    cmd = [sys.executable, str(SCRIPT), "--artifact", str(tiny_artifact), "--requests", "200",
           "--clients", "16", "--max-tokens", "16", "--threads", "1", "--time-limit", "120",
           "--json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["completed"] == 200 and summary["errors"] == 0, summary["error_samples"]
    assert summary["metrics_agree"] and summary["server_exit_code"] == 0
    assert summary["rss_growth_mib"] < 8, summary["rss_mib"]
    assert done.returncode == 0, done.stderr
