"""How much a maximum-size request body raises the proxy's memory, by body shape.

    python bench/bench_body_memory.py [--mib 32] [--shapes text,stream,image,tools,astral]

For each shape, a fresh ``tokenward serve`` process (with a blocking budget, so the budget's
worst case is counted from the body) gets one small request, then one body just under
``--mib`` MiB; the figure is the growth of its peak resident memory (Linux ``VmHWM``, reset
just before the large request) over its resident memory then, in MiB and as a multiple of the
body size. The upstream is the simulator, in this process, replaying a recorded completion.

Shapes: ``text`` one long chat message; ``stream`` the same with ``stream: true`` (tokenward
then splices ``stream_options`` in); ``image`` a base64 image part; ``tools`` one huge tool
definition (counted as its JSON); ``astral`` ASCII text with one character outside the Basic
Multilingual Plane, which Python stores at 4 bytes a character once decoded.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenward.proxy.simulator import (  # noqa: E402
    RECORD_HEADER,
    SimulatorServer,
    load_recordings,
    sample_recordings_path,
)

CHAT = "tests/models/cassettes/test_openai/test_extra_headers.yaml#0"
MIB = 1024 * 1024
WORDS = "lorem ipsum dolor sit amet, consectetur adipiscing elit. "


def body_for(shape: str, size: int) -> bytes:
    """A chat request of about ``size`` bytes (at most ``size``) of the given shape."""
    room = size - 400
    if shape in ("text", "stream", "astral"):
        text = (WORDS * (room // len(WORDS) + 1))[:room]
        if shape == "astral":
            text = "\U0001f916" + text[2:]  # one emoji: 4 UTF-8 bytes, and every character of the str at 4 bytes
        document = {"model": "gpt-4o", "messages": [{"role": "user", "content": text}], "stream": shape == "stream"}
    elif shape == "image":
        part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "iVBORw0K" * (room // 8)}}
        document = {"model": "gpt-4o", "messages": [{"role": "user", "content": [{"type": "text", "text": "?"}, part]}]}
    elif shape == "tools":
        description = (WORDS * (room // len(WORDS) + 1))[:room]
        tool = {"type": "function", "function": {"name": "f", "description": description, "parameters": {}}}
        document = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    else:
        raise SystemExit(f"unknown shape {shape!r}")
    raw = json.dumps(document, ensure_ascii=False).encode()
    assert len(raw) <= size, (shape, len(raw), size)
    return raw


def memory_mib(pid: int) -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def measure(shape: str, size: int, upstream: str, directory: Path) -> tuple[float, float, float, int]:
    """(peak growth MiB, RSS growth after MiB, seconds, status) for one body of ``shape``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = directory / f"{shape}.yaml"
    config.write_text(
        f"server: {{port: {port}, max_body_mib: {size / MIB + 1}}}\n"
        f"ledger: {{path: {shape}.duckdb}}\n"
        f'upstreams: [{{name: openai, base_url: "{upstream}/openai/v1", provider: openai, default: true}}]\n'
        "budgets: [{name: all, limit_usd: 100000, period: month, action: block}]\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenward.proxy", "serve", "--config", str(config), "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("proxy did not start")
            time.sleep(0.1)
        body = body_for(shape, size)
        with httpx.Client(timeout=300, headers={RECORD_HEADER: CHAT}) as client:
            small = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
            client.post(f"{url}/v1/chat/completions", json=small)  # loads the tokenizer
            time.sleep(0.5)
            Path(f"/proc/{process.pid}/clear_refs").write_text("5")
            before, _ = memory_mib(process.pid)
            started = time.perf_counter()
            reply = client.post(f"{url}/v1/chat/completions", content=body)
            took = time.perf_counter() - started
            _, peak = memory_mib(process.pid)
            time.sleep(0.5)
            after, _ = memory_mib(process.pid)
        return peak - before, after - before, took, reply.status_code
    finally:
        process.terminate()
        process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=32.0, help="body size in MiB (default: max_body_mib's default)")
    parser.add_argument("--shapes", default="text,stream,image,tools,astral")
    args = parser.parse_args()
    if not Path("/proc/self/clear_refs").exists():
        raise SystemExit("needs Linux /proc")
    size = int(args.mib * MIB)
    with (
        SimulatorServer(load_recordings(sample_recordings_path())).running() as sim,
        tempfile.TemporaryDirectory() as d,
    ):
        print(f"body {size / MIB:.1f} MiB; peak = growth of peak RSS during the request; after = RSS 0.5 s later")
        print(f"{'shape':8} {'status':>6} {'peak MiB':>9} {'x body':>7} {'after MiB':>10} {'seconds':>8}")
        for shape in args.shapes.split(","):
            peak, after, took, status = measure(shape, size, sim.url, Path(d))
            print(f"{shape:8} {status:>6} {peak:>9.0f} {peak / (size / MIB):>7.2f} {after:>10.0f} {took:>8.2f}")


if __name__ == "__main__":
    main()
