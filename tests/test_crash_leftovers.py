"""What a kill leaves in the write-ahead log directory, as the reports and the next start read it.

Real files: a write-ahead log written by :class:`WriteAheadLog`, a DuckDB ledger, and the real
``tokenward report`` command in a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

from tokenward.reports.ledger import DuckLedger, WriteAheadLog, write_rows
from tokenward.reports.ledger.wal import dead_writers, encode_row

from .test_ledger import make_row


def _logged(ledger: DuckLedger, rows: list[dict]) -> None:
    """A proxy's log with ``rows`` committed, its lock released as the kernel releases a killed process's."""

    async def write() -> None:
        wal = WriteAheadLog(ledger.spool_dir)
        wal.open(asyncio.get_running_loop())
        for row in rows:
            await wal.commit([row["request_id"]], encode_row(row))
        wal.close()

    asyncio.run(write())


def _report(path: Path) -> list[dict]:
    tokenward = Path(sys.executable).parent / "tokenward"
    done = subprocess.run(
        [str(tokenward), "report", "--db", str(path), "--format", "json"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_report_during_a_recovery_cut_short_by_a_kill_counts_each_row_once(tmp_path):
    """The next start recovering a dead writer writes its rows to one ``-recovered`` file, inserts it, then
    removes the writer's files. Killed between the two, both are on disk until the start after.

    Ledger: one $1 row. Log: three $2 rows. ``tokenward report`` meanwhile: 4 requests, $7. Before,
    it read both files: 7 requests, $13.
    """
    path = tmp_path / "l.duckdb"
    write_rows(path, [make_row("seed", cost_usd=Decimal(1))])
    ledger = DuckLedger(path)
    _logged(ledger, [make_row(f"r{n}", cost_usd=Decimal(2)) for n in range(3)])
    (writer,) = dead_writers(ledger.spool_dir)
    writer.recovered_file()  # the recovery's first step, then SIGKILL before its insert
    writer.release()
    names = sorted(p.name.split("-", 1)[1] for p in ledger.spool_dir.glob("*.rows.jsonl"))
    assert names == ["00000000.rows.jsonl", "recovered.rows.jsonl"]
    (line,) = _report(path)
    assert (line["requests"], Decimal(line["cost_usd"])) == (4, Decimal(7))
    # the next start recovers it: one row each in the file, and the report agrees
    assert ledger.flush() == 3
    assert list(ledger.spool_dir.glob("*.rows.jsonl")) == []
    (line,) = _report(path)
    assert (line["requests"], Decimal(line["cost_usd"])) == (4, Decimal(7))
