"""Schemathesis against the gateway's own OpenAPI schema on a real fleet: no 5xx, no undocumented
status or content type, no response that violates the schema, no schema-violating request
accepted. (Schema-valid requests the fleet still refuses, such as token ids past the vocabulary,
are allowed to get 400, so that one check is left out.)"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import running_fleet


@pytest.fixture(scope="module")
def small_fleet():
    # A 48-token window keeps every generated request short.
    with running_fleet(worker_args=("--max-model-len", "48")) as f:
        yield f


def test_schemathesis_finds_nothing(small_fleet, tmp_path):
    st = shutil.which("st") or shutil.which("schemathesis")
    cmd = [st] if st else [sys.executable, "-m", "schemathesis.cli"]
    r = subprocess.run([*cmd, "run", small_fleet["url"] + "/openapi.json", "--max-examples", "40",
                        "--workers", "2", "--seed", "1", "--exclude-checks",
                        "positive_data_acceptance"], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-4000:]
    assert "No issues found" in r.stdout
