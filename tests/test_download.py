"""data/tasks.py download (eval.tasks=[hellaswag]) on a machine without a network, and against a server in
trouble, with no network: a local server that answers as it is told, a local port that refuses, and urlopen
replaced where the failure cannot be made locally. Only a server's passing trouble is tried again."""
import http.client
import http.server
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

import data.tasks
from common.checks import ConfigError
from data.tasks import download

FIX = "place it there by hand"


@pytest.fixture
def waits(monkeypatch) -> list:
    """The seconds download sleeps between attempts, recorded, not slept."""
    slept = []
    monkeypatch.setattr(data.tasks.time, "sleep", slept.append)
    return slept


@pytest.fixture
def server():
    """A local HTTP server answering each GET with the next (status, body) of its `script`, the last one again
    once the script is done; `calls` counts the requests."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = state["script"][min(state["calls"], len(state["script"]) - 1)]
            state["calls"] += 1
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    state = {"script": [(200, b"")], "calls": 0}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    state["url"] = f"http://127.0.0.1:{httpd.server_address[1]}/hellaswag_val.jsonl"
    yield state
    httpd.shutdown()
    httpd.server_close()


def refused_url() -> tuple[str, socket.socket]:
    """A local port bound but not listening: a connection to it is refused at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return f"http://127.0.0.1:{sock.getsockname()[1]}/hellaswag_val.jsonl", sock


def attempts(monkeypatch, error: Exception) -> list:
    """urlopen replaced by one that raises `error`; returns the list its calls are counted in."""
    calls = []

    def failing(url, timeout):
        calls.append(timeout)
        raise error
    monkeypatch.setattr(urllib.request, "urlopen", failing)
    return calls


def refused(url: str, path) -> str:
    with pytest.raises(ConfigError) as caught:
        download(url, str(path), FIX)
    assert not path.exists() and list(path.parent.iterdir()) == []  # no file, no half file
    return str(caught.value)


def test_a_refused_connection_ends_the_first_attempt(tmp_path, waits):
    url, sock = refused_url()
    with sock:
        start = time.monotonic()
        message = refused(url, tmp_path / "hellaswag_val.jsonl")
    assert time.monotonic() - start < 5 and waits == []
    assert message == (f"could not download {url} to {tmp_path}/hellaswag_val.jsonl: the connection was refused "
                       f"([Errno 111] Connection refused); fix: {FIX}")


@pytest.mark.parametrize("reason,said", [
    (socket.gaierror(-2, "Name or service not known"),
     "the host name does not resolve, no network? ([Errno -2] Name or service not known)"),
    (OSError(101, "Network is unreachable"), "the network is unreachable, no network? ([Errno 101] Network is "
                                             "unreachable)"),
    (TimeoutError("timed out"), "no answer within 20 s (timed out)"),  # to connect: a firewall that drops it
], ids=["dns", "unreachable", "connect-timeout"])
def test_no_network_ends_the_first_attempt(tmp_path, monkeypatch, waits, reason, said):
    calls = attempts(monkeypatch, urllib.error.URLError(reason))
    message = refused("https://example.invalid/hellaswag_val.jsonl", tmp_path / "hellaswag_val.jsonl")
    assert calls == [20] and waits == []
    assert message == (f"could not download https://example.invalid/hellaswag_val.jsonl to {tmp_path}/"
                       f"hellaswag_val.jsonl: {said}; fix: {FIX}")


def test_a_client_error_ends_the_first_attempt(tmp_path, server, waits):
    server["script"] = [(404, b"not here")]
    message = refused(server["url"], tmp_path / "hellaswag_val.jsonl")
    assert server["calls"] == 1 and waits == []
    assert message.endswith(f": HTTP 404 Not Found; fix: {FIX}")


def test_a_server_error_is_tried_again_and_the_file_written(tmp_path, server, waits):
    server["script"] = [(503, b"busy"), (500, b"oops"), (200, b'{"ctx": "a"}\n')]
    path = tmp_path / "hellaswag_val.jsonl"
    download(server["url"], str(path), FIX)
    assert path.read_bytes() == b'{"ctx": "a"}\n'
    assert server["calls"] == 3 and waits == [2, 4]


def test_a_server_error_that_lasts_ends_after_the_last_attempt(tmp_path, server, waits):
    server["script"] = [(503, b"busy")]
    message = refused(server["url"], tmp_path / "hellaswag_val.jsonl")
    assert server["calls"] == 3 and waits == [2, 4]
    assert message.endswith(f" (attempt 3 of 3): HTTP 503 Service Unavailable; fix: {FIX}")


@pytest.mark.parametrize("error", [TimeoutError("The read operation timed out"),
                                   ConnectionResetError(104, "Connection reset by peer"),
                                   http.client.IncompleteRead(b"{")],
                         ids=["read-timeout", "reset", "cut-short"])
def test_a_transfer_that_stalls_or_breaks_off_is_tried_again(tmp_path, monkeypatch, waits, error):
    calls = attempts(monkeypatch, error)
    message = refused("https://example.invalid/hellaswag_val.jsonl", tmp_path / "hellaswag_val.jsonl")
    assert len(calls) == 3 and waits == [2, 4]
    assert " (attempt 3 of 3): " in message and message.endswith(f"; fix: {FIX}")
