"""deepinfer-serve's start-up and its /health under the connection cap (issue 44 item 6), as the real CLI
in a subprocess:

- the address is checked before the bundle loads: a taken port, a host that does not resolve and one
  that is not this machine's are each refused in one line with exit status 2, and nothing of the bundle
  is loaded first (the refusal is the only line: no "loading bundle" line came before it);
- a server that starts says on stderr what it loads, then on stdout where it serves; a second server on
  its port is refused the same way;
- idle clients holding every connection (--max-connections) do not make /health a 503 (a liveness probe
  would restart a healthy server); any other request past the cap still gets the cap's 503.

Every wait is bounded; nothing is asserted on timing."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from deepinfer.runtime.serving.limits import HEALTH_SPARE
from deepinfer.runtime.serving.server_process import ServerProcess

CAP = 4  # --max-connections of `capped`
REQUEST_TIMEOUT_S = 60
EXIT_TIMEOUT_S = 120  # the CLI's imports on a busy 2-core machine; the refusal itself is immediate
LOADING = "deepinfer-serve: loading bundle"


def serve_cli(bundle, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.runtime.serving.cli", str(bundle), *args],
        capture_output=True,
        text=True,
        timeout=EXIT_TIMEOUT_S,
    )


def refused_in_one_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and LOADING not in done.stderr, done.stderr
    assert done.stdout == ""
    return lines[0]


def test_a_taken_port_is_refused_before_the_load(aoti_bundle):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        line = refused_in_one_line(serve_cli(aoti_bundle, "--host", "127.0.0.1", "--port", str(port)))
    assert f"--port {port}" in line and "in use" in line and "--port 0" in line


@pytest.mark.parametrize(
    "host, words",
    [
        ("no.such.host.invalid", "does not resolve"),
        ("not a host", "does not resolve"),
        ("300.1.2.3", "does not resolve"),
        ("::zz", "does not resolve"),
        ("a" * 300, "does not resolve"),  # a label longer than DNS allows
        ("192.0.2.1", "not an address of this machine"),  # TEST-NET-1: resolves, is never local
    ],
    ids=["unresolvable", "spaces", "octet", "ipv6", "long-label", "not-local"],
)
def test_a_bad_host_is_refused_before_the_load(aoti_bundle, host, words):
    line = refused_in_one_line(serve_cli(aoti_bundle, "--host", host, "--port", "0"))
    assert "--host " in line and words in line, line


@pytest.fixture(scope="module")
def capped(aoti_bundle):
    """A server with 4 connections at most, whose idle clients stay until they are closed here."""
    server = ServerProcess(aoti_bundle, "--threads", "1", "--max-connections", str(CAP), "--header-timeout-s", "600")
    yield server
    assert server.stop() == 0


def test_a_server_says_what_it_loads_and_holds_its_port(capped, aoti_bundle):
    assert capped.proc.stderr is not None  # ServerProcess pipes it
    loading = capped.proc.stderr.readline()  # written before the ready line it has printed
    assert loading.startswith(LOADING) and "executables" in loading and capped.url in loading, loading
    port = capped.url.rsplit(":", 1)[1]
    line = refused_in_one_line(serve_cli(aoti_bundle, "--host", "127.0.0.1", "--port", port))
    assert "in use" in line


def get(url: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url + path, timeout=REQUEST_TIMEOUT_S) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_health_answers_while_idle_clients_hold_every_connection(capped):
    host, port = capped.url.removeprefix("http://").split(":")
    # the cap's places, and more than its spare places for /health, all held by idle clients
    idle = [
        socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S) for _ in range(CAP + HEALTH_SPARE + 2)
    ]
    try:
        for c in idle:
            c.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        status, body = get(capped.url, "/health")
        assert status == 200 and json.loads(body) == {"status": "ok"}, body
        status, body = get(capped.url, "/v1/models")  # anything else past the cap: the cap's 503
        assert status == 503 and b"--max-connections" in body, body
    finally:
        for c in idle:
            c.close()
    deadline = time.monotonic() + REQUEST_TIMEOUT_S  # until the server has seen them close
    while get(capped.url, "/v1/models")[0] != 200:
        assert time.monotonic() < deadline, "the cap's places were not given back"
        time.sleep(0.1)
