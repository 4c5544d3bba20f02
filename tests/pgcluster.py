"""A throwaway Postgres cluster for tests and benchmarks: initdb in a temp dir, 127.0.0.1, a free port.

Uses Debian's ``postgresql`` package (``/usr/lib/postgresql/<version>/bin``). Postgres refuses to
run as root, so as root the cluster belongs to the ``postgres`` system user (created by the
package) and is started through ``runuser``. ``start_cluster()`` returns ``None`` when no server
binaries are installed (the tests then skip).
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Cluster", "find_bin", "start_cluster"]


def find_bin() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding ``initdb``, or ``None``."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Cluster:
    """A running cluster; :meth:`url` names a database on it, :meth:`stop` ends and removes it."""

    bin: Path
    data: Path
    port: int
    user: str | None  # the system user it runs as (None: the current one)
    root: Path

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / args[0]), *args[1:]]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        return subprocess.run(command, check=check, capture_output=True, text=True, timeout=120)

    def url(self, database: str = "postgres") -> str:
        """A ``postgresql://`` URL for ``database`` (trust authentication, user ``tokenward``)."""
        return f"postgresql://tokenward@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """Create database ``name`` and return its URL."""
        self._run(
            "psql",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "tokenward",
            "-d",
            "postgres",
            "-c",
            f'CREATE DATABASE "{name}"',
        )
        return self.url(name)

    def stop(self) -> None:
        """Stop the server (fast shutdown) and delete its files."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop", check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def halt(self) -> None:
        """Stop the server, keeping its files (for :meth:`resume`)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)

    def resume(self) -> None:
        """Start the server again after :meth:`halt`."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-w", "-t", "60", "start")

    def restart(self) -> None:
        """Restart the server as an operator does (fast shutdown: sessions ended, a checkpoint), and wait."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-m", "fast", "-w", "-t", "60", "restart")


def start_cluster() -> Cluster | None:
    """Init and start a cluster in a new temp dir; ``None`` without Postgres binaries.

    Raises:
        subprocess.CalledProcessError: initdb or the server failed (the message holds its output).
    """
    bin_dir = find_bin()
    if bin_dir is None:
        return None
    root = Path(tempfile.mkdtemp(prefix="tokenward-pg-"))
    user = "postgres" if os.geteuid() == 0 else None
    if user is not None:
        shutil.chown(root, user)
    os.chmod(root, 0o755)
    cluster = Cluster(bin_dir, root / "data", _free_port(), user, root)
    cluster._run("initdb", "-D", str(cluster.data), "-U", "tokenward", "--auth=trust", "-E", "UTF8", "--no-sync")
    settings = [
        "listen_addresses = '127.0.0.1'",
        f"port = {cluster.port}",
        f"unix_socket_directories = '{root}'",
        "fsync = off",
        "synchronous_commit = off",
        "full_page_writes = off",
        "max_connections = 200",
        "shared_buffers = 128MB",
    ]
    with open(cluster.data / "postgresql.conf", "a", encoding="utf-8") as conf:
        conf.write("\n".join(settings) + "\n")
    for _ in range(3):
        try:
            cluster.resume()
            break
        except subprocess.CalledProcessError:  # the port was taken in between: pick another
            cluster.port = _free_port()
            with open(cluster.data / "postgresql.conf", "a", encoding="utf-8") as conf:
                conf.write(f"port = {cluster.port}\n")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if cluster._run("pg_isready", "-h", "127.0.0.1", "-p", str(cluster.port), check=False).returncode == 0:
            return cluster
        time.sleep(0.1)
    cluster.stop()
    raise RuntimeError("the test Postgres cluster did not come up")
