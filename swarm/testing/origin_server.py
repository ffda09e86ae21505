"""A real HTTP origin for tests: Debian's nginx (``nginx-light``) serving a directory on loopback.

``with origin_server(root) as srv:`` starts ``nginx`` (master + one worker, ``daemon off``) on a
free 127.0.0.1 port and yields :class:`OriginServer` (``url``, ``kill_worker()`` to cut every
connection in flight, ``bytes_sent()`` from its access log). ``ranges=False`` sets
``max_ranges 0`` so nginx answers Range requests with 200 and the whole file; ``token`` makes it
answer 401 unless ``Authorization: Bearer <token>``. :func:`have_nginx` says whether the binary
is installed (tests skip naming the package otherwise).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
SKIP_REASON = "needs nginx (Debian package nginx-light: apt-get install nginx-light)"


def have_nginx() -> bool:
    return os.access(NGINX, os.X_OK)


@dataclass
class OriginServer:
    url: str
    root: Path
    work: Path
    proc: subprocess.Popen[bytes]

    def worker_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    def kill_worker(self) -> None:
        """SIGKILL nginx's worker: every transfer in flight is cut; the master starts a new one."""
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def requests(self) -> list[tuple[str, int, int]]:
        """(request line, status, body bytes sent) per request, from the access log."""
        log = self.work / "access.log"
        out = []
        for line in log.read_text().splitlines() if log.exists() else []:
            req, status, sent = line.rsplit("\t", 2)
            out.append((req, int(status), int(sent)))
        return out

    def bytes_sent(self) -> int:
        return sum(s for _, _, s in self.requests())

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until nginx holds no client connection open, so that ``requests()`` is complete: nginx
        writes a request's log line before it closes the connection, and a transfer its client cut
        ends only when nginx next writes to it (later on a busy machine). Close the clients first:
        an idle keep-alive connection counts as open."""
        port = f":{int(self.url.rsplit(':', 1)[1]):04X}"
        deadline = time.monotonic() + timeout
        while True:
            rows = [r.split() for r in Path("/proc/net/tcp").read_text().splitlines()[1:]]
            # the local address ends in nginx's port; 01 ESTABLISHED, 08 CLOSE_WAIT: nginx still holds it
            if not any(r[1].endswith(port) and r[3] in ("01", "08") for r in rows):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"nginx at {self.url} still holds connections after {timeout} s")
            time.sleep(0.02)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def origin_server(root: Path, work: Path, *, ranges: bool = True, token: str | None = None,
                  rate: str | None = None) -> Iterator[OriginServer]:  # fmt: skip
    """nginx serving ``root`` (its config, logs and temp files under ``work``)."""
    work.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    auth = f'if ($http_authorization != "Bearer {token}") {{ return 401; }}' if token else ""
    conf = f"""
user root; daemon off; master_process on; worker_processes 1;
pid {work}/nginx.pid; error_log {work}/error.log warn;
events {{ worker_connections 256; }}
http {{
  log_format plain '$request\\t$status\\t$body_bytes_sent';
  access_log {work}/access.log plain;
  client_body_temp_path {work}/body; proxy_temp_path {work}/proxy; fastcgi_temp_path {work}/fcgi;
  uwsgi_temp_path {work}/uwsgi; scgi_temp_path {work}/scgi;
  default_type application/octet-stream;
  server {{
    listen 127.0.0.1:{port};
    root {root};
    max_ranges {"16" if ranges else "0"};
    {f"limit_rate {rate};" if rate else ""}
    location / {{ {auth} }}
  }}
}}
"""
    (work / "nginx.conf").write_text(conf)
    proc = subprocess.Popen([NGINX, "-p", str(work), "-e", str(work / "error.log"), "-c", str(work / "nginx.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 10.0
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"nginx exited with {proc.returncode}: {err.strip()[:400]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not listen on 127.0.0.1:{port} within 10 s")
            time.sleep(0.05)
        yield OriginServer(f"http://127.0.0.1:{port}", root, work, proc)
    finally:
        proc.send_signal(signal.SIGQUIT)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
