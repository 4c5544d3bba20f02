"""SSE decoding and metering cost: linear in the input, whatever the event boundaries.

    python bench/bench_sse.py [--mb 16] [--read 65536]

Prints the CPU seconds the decoder and the meter take for: one event of ``--mb`` MiB with no
boundary (the worst case for a decoder that rebuilds its buffer on every read), and the same
number of bytes as ordinary 300-byte chat chunks; then the per-event metering cost of a
recorded-shape chat stream. Figures are CPU time of this process (``time.process_time``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenward.proxy.metering import Meter  # noqa: E402
from tokenward.proxy.sse import SSEDecoder  # noqa: E402


def cpu(feed, data: bytes, read: int) -> float:
    start = time.process_time()
    for offset in range(0, len(data), read):
        feed(data[offset : offset + read])
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=16)
    parser.add_argument("--read", type=int, default=65536)
    args = parser.parse_args()
    size = args.mb * 1024 * 1024
    endless = b"data: " + b"x" * size
    chunk = {"id": "c", "object": "chat.completion.chunk", "model": "gpt-4o-mini", "choices": []}
    event = b"data: " + json.dumps(chunk | {"choices": [{"index": 0, "delta": {"content": "y" * 200}}]}).encode()
    events = (event + b"\n\n") * (size // (len(event) + 2))
    print(f"{args.mb} MiB in {args.read}-byte reads:")
    for label, data in (("no event boundary", endless), (f"{len(event) + 2}-byte events", events)):
        uncapped = cpu(SSEDecoder(max_event_bytes=None).feed, data, args.read)
        capped = cpu(SSEDecoder().feed, data, args.read)
        metered = cpu(Meter("openai").feed_stream, data, args.read)
        print(f"  {label:22s} decoder {uncapped:6.3f} s (8 MiB cap: {capped:6.3f} s), meter {metered:6.3f} s CPU")
    count = events.count(b"\n\n")
    per_event = cpu(Meter("openai").feed_stream, events, 4096) / count * 1e6
    print(f"meter, 4 KiB reads: {per_event:.2f} us CPU per event ({count} events)")


if __name__ == "__main__":
    main()
