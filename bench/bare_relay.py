"""The floor: a bare Python relay (aiohttp client under uvicorn with uvloop and httptools), no parsing.

Every request goes to ``--upstream`` plus the request's own path and query, with the client's
headers (less hop-by-hop ones and ``host``) and body bytes; the reply's status, headers and body
chunks come back as they arrive (``iter_any``: one ASGI body message per upstream read). Nothing
is decoded, metered or recorded. ``bench/bench_floor.py`` measures tokenward against it: what
tokenward costs above this is what metering, routing and Litestar cost.

    python bench/bare_relay.py --port 9401 --upstream http://127.0.0.1:9301
"""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
import uvicorn
from multidict import CIMultiDict

_HOP_BY_HOP = frozenset(  # the same set as tokenward.proxy.relay.HOP_BY_HOP; the floor imports nothing of tokenward
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_NOT_SENT = _HOP_BY_HOP | {b"host", b"content-length"}


class Relay:
    """ASGI app: forward to one upstream, relay the reply back, nothing else."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        url = self.upstream + scope["raw_path"].decode("latin-1")
        if scope["query_string"]:
            url += "?" + scope["query_string"].decode("latin-1")
        headers = CIMultiDict(
            [(n.decode("latin-1"), v.decode("latin-1")) for n, v in scope["headers"] if n not in _NOT_SENT]
        )
        assert self.session is not None
        try:
            async with self.session.request(
                scope["method"], url, headers=headers, data=body, allow_redirects=False, compress=None
            ) as response:
                reply_headers = [(n.lower(), v) for n, v in response.raw_headers if n.lower() not in _HOP_BY_HOP]
                await send({"type": "http.response.start", "status": response.status, "headers": reply_headers})
                async for chunk in response.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except aiohttp.ClientError:
            return  # the upstream broke off: so does the reply (uvicorn closes the connection)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=1000, limit_per_host=0),
                    auto_decompress=False,
                    skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                    timeout=aiohttp.ClientTimeout(total=None, sock_read=600),
                    trust_env=False,
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=9401)
    parser.add_argument("--upstream", default="http://127.0.0.1:9301")
    args = parser.parse_args()
    uvicorn.run(
        Relay(args.upstream),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level="warning",
        access_log=False,
        server_header=False,
        date_header=False,
    )
