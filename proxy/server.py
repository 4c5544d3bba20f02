"""Running the proxy app under uvicorn: in the foreground (``serve``) or in a thread (demo, tests)."""

from __future__ import annotations

import faulthandler
import gc
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from litestar import Litestar

from tokenward.proxy.config import ServerConfig
from tokenward.proxy.front import front
from tokenward.proxy.limits import return_large_buffers, uvicorn_options
from tokenward.reports.sanitize import escape_log_lines

__all__ = ["GEN0_THRESHOLD", "HANGUP_WARNING", "ignore_hangup", "run", "running_in_thread", "settle_collector"]

log = logging.getLogger("tokenward.proxy")

HANGUP_WARNING = (
    "SIGHUP received and ignored: tokenward does not reload its configuration; restart it to apply "
    "config changes (SIGTERM lets requests in flight finish). Keys made or revoked with `tokenward keys` "
    "apply within 5 s without a restart."
)
"""What the log says on SIGHUP (which would otherwise end the process at once, streams and rows cut)."""


def _uvicorn_config(app: Litestar, host: str, port: int, log_level: str, access_log: bool) -> uvicorn.Config:
    settings = _server_settings(app)
    return uvicorn.Config(
        front(app),  # /v1 straight to the forwarder, the rest to Litestar (proxy/front.py)
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        server_header=False,  # the upstream's own Server and Date headers are relayed instead
        date_header=False,
        lifespan="on",
        # a stop waits this long for requests in flight, then cancels them (proxy/front.py answers those)
        timeout_graceful_shutdown=settings.shutdown_grace_s,
        **uvicorn_options(settings),
    )


def _server_settings(app: Litestar) -> ServerConfig:
    config = getattr(app.state, "config", None)  # set by create_app
    return config.server if config is not None else ServerConfig()


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` for :func:`run` (IPv6 when ``host`` has a colon), before anything starts.

    Raises:
        OSError: the address is in use (``errno.EADDRINUSE``) or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT does not block
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def run(
    app: Litestar,
    host: str,
    port: int,
    *,
    log_level: str = "info",
    access_log: bool = False,
    sock: socket.socket | None = None,
) -> None:
    """Serve ``app`` until interrupted; on SIGINT/SIGTERM in-flight requests finish and the ledger is flushed.

    ``sock``: a socket from :func:`listening_socket` (else uvicorn binds ``host``:``port`` itself).
    SIGHUP (a config reload elsewhere, a closed terminal) is logged and ignored: see :func:`ignore_hangup`.
    Control characters in log lines (client-supplied paths, model names) are escaped on every
    handler configured by then (see :mod:`tokenward.reports.sanitize`), and large freed buffers
    go back to the OS (:func:`tokenward.proxy.limits.return_large_buffers`).
    """
    config = _uvicorn_config(app, host, port, log_level, access_log)  # configures uvicorn's log handlers
    escape_log_lines()
    return_large_buffers()
    ignore_hangup()
    settle_collector()
    uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)


def ignore_hangup() -> None:
    """Make SIGHUP log :data:`HANGUP_WARNING` instead of ending the process (main thread only; a no-op elsewhere).

    SIGHUP's default action kills the process on the spot: no graceful shutdown, open streams cut
    mid-reply, their rows left for the next start to record as ``interrupted``. Operators send it
    to reload a config (``systemctl reload``, ``kill -HUP``); tokenward has no reload, so it says so.
    """
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGHUP, lambda signum, frame: log.warning("%s", HANGUP_WARNING))


GEN0_THRESHOLD = 7000
"""Allocations (less frees) of tracked objects between young collections; Python's default is 700."""


def settle_collector() -> None:
    """Take start-up objects out of the garbage collector's scans, and collect the young generation less often.

    Once the app is built, some 80,000 objects (modules, the price catalog, the app) would be
    scanned by every full collection (~25 ms each, paid by whichever request's allocation set it
    off): ``gc.freeze()`` moves them to a generation that is never scanned. A request allocates
    a few hundred tracked objects, nearly all freed by reference counting; with the default
    threshold of 700 a young collection (~0.2 ms over the state of the requests in flight) ran
    every ~16 requests at 64 concurrent, with 7,000 every ~1,000 (``bench/PROFILE.md``). Call
    once before serving; process-wide (tests serving in a thread leave the collector alone).
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, older, oldest)


START_WAIT_S = 60
"""How long :func:`running_in_thread` waits for the start (a loaded machine's test process can take 10 s)."""
SHUTDOWN_WAIT_S = 60
"""How long :func:`running_in_thread` waits for the lifespan's shutdown, after ``server.shutdown_grace_s``."""


@contextmanager
def running_in_thread(app: Litestar, host: str = "127.0.0.1", *, log_level: str = "warning") -> Iterator[str]:
    """Serve ``app`` on a free port in a background thread; yields its base URL (``http://host:port``).

    On exit the server shuts down gracefully (lifespan shutdown included: the ledger is flushed).

    Raises:
        RuntimeError: the server did not start within :data:`START_WAIT_S`, or did not shut down within
            ``server.shutdown_grace_s`` plus :data:`SHUTDOWN_WAIT_S` (every thread's stack is written to stderr first).
    """
    sock = listening_socket(host, 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(_uvicorn_config(app, host, port, log_level, False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="tokenward-proxy")
    thread.start()
    deadline = time.monotonic() + START_WAIT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("proxy server did not start")
        time.sleep(0.005)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        wait_s = _server_settings(app).shutdown_grace_s + SHUTDOWN_WAIT_S
        thread.join(wait_s)
        sock.close()
        if thread.is_alive():  # the ledger is not flushed yet: say so, and where the shutdown is stuck
            faulthandler.dump_traceback(all_threads=True)
            raise RuntimeError(f"proxy server did not shut down within {wait_s:g} s")
