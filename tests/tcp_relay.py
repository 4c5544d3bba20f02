"""A TCP relay between a client and a server whose open connections can die silently (:meth:`Relay.freeze`).

Frozen connections stay open on both sides (no FIN, no RST) and every byte sent on them
afterwards is dropped: what a NAT or firewall that forgot a connection does. Connections made
after the freeze pass as usual.
"""

from __future__ import annotations

import socket
import threading

__all__ = ["Relay"]


class _Pair:
    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.frozen = False

    def pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if not self.frozen:
                    sink.sendall(data)
        except OSError:
            pass
        if not self.frozen:  # a close passes through while the path is alive
            for sock in (self.client, self.server):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Relay:
    """Listen on 127.0.0.1 (``port``) and relay every connection to ``target_port`` on 127.0.0.1."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.pairs: list[_Pair] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            pair = _Pair(client, server)
            with self._lock:
                self.pairs.append(pair)
            threading.Thread(target=pair.pump, args=(client, server), daemon=True).start()
            threading.Thread(target=pair.pump, args=(server, client), daemon=True).start()

    def freeze(self) -> int:
        """Silently drop every byte on the connections open now; returns how many there are."""
        with self._lock:
            live = [pair for pair in self.pairs if not pair.frozen]
            for pair in live:
                pair.frozen = True
        return len(live)

    def close(self) -> None:
        """Stop listening and close every connection."""
        self._listener.close()
        with self._lock:
            for pair in self.pairs:
                for sock in (pair.client, pair.server):
                    sock.close()
