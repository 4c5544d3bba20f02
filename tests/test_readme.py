"""Every example in README.md runs as written, in order, in a fresh directory, against the simulator.

The README's shell examples (its 4-space indented blocks), Python blocks and YAML and JSON blocks
are taken from the file itself, so a README edit is tested with no edit here. Shell lines run
with ``bash`` in a temporary directory laid out like a checkout (``config.example.yaml`` and
``.venv``); a line ending in ``&`` starts a server, which is waited for and stopped at the end.
YAML blocks must load as configuration or price files, JSON blocks must parse (and the health
example must show the fields ``/healthz`` really returns).

What the test changes, each for a reason (:data:`SUBSTITUTIONS`): the ports (4000 and 9100 may be
taken on a shared machine) and the README's one placeholder, ``<request id>``. What it leaves
out needs a real provider or service (:data:`EXEMPT`); each entry says why and where else the
same thing is tested. Both lists must match README lines, so neither can go stale.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from tokenward.pricing.catalog import load_catalog
from tokenward.proxy.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

EXEMPT = {
    "tokenward top": "a live view of a running proxy that refreshes until Ctrl-C; "
    "tests/test_top.py drives it in a pty against a real proxy (and runs --once)",
    "make run": "starts the proxy in front of the real providers of config.example.yaml; "
    "tests/test_cli_start.py::test_make_run_takes_a_port runs it",
    "make test": "runs this very suite",
    "from openai import AzureOpenAI": "needs an Azure upstream (provider: azure), which the README's running "
    "proxy (the simulator's OpenAI upstream) lacks; tests/test_azure_deployments.py and tests/test_azure_api.py send AzureOpenAI clients "
    "through tokenward",
    "tokenward alerts test --to me@example.com --config config.yaml": "needs an SMTP server; "
    "tests/test_alerts.py::test_alerts_test_command runs this command against a real one (aiosmtpd)",
}
"""README examples not run here (matched by their start), and why."""

SUBSTITUTIONS = {
    "127.0.0.1:4000": "the proxy's port: 4000 may be in use on a shared machine",
    "--port 4000": "the same",
    "127.0.0.1:9100": "the simulator's port, likewise",
    "--port 9100": "the same",
    "<request id>": "a placeholder: the id of the request the first example sent",
}
"""What is replaced in the README's examples before they run, and why."""

INPUT_FILES = {
    # the user's own downloads, which the pricing import examples convert
    "model_prices_and_context_window.json": json.dumps(
        {
            "gpt-4o-mini": {
                "litellm_provider": "openai",
                "mode": "chat",
                "input_cost_per_token": 1.5e-07,
                "output_cost_per_token": 6e-07,
            }
        }
    ),
    "sheet.csv": "provider,model,component,unit,price\nacme,acme-large,input,1M,3.00\nacme,acme-large,output,1K,0.012\n",
}

EXPECT = {
    "print(reply.usage.prompt_tokens, reply.usage.completion_tokens)": "8 ",  # "user", "hi", 3 a message, 3
    ".venv/bin/tokenward report --by model": "gpt-4o-mini",
    "tokenward report --since 7d": "gpt-4o-mini",
    "tokenward config check --config config.yaml": "config.yaml: ok (5 upstreams",
    "tokenward keys create ci-bot --team platform --project evals --db tokenward.duckdb": "tw-",
    "tokenward pricing explain <request id> --config config.yaml": "gpt-4o-mini",
    'print(f"stopped before step {step} with ${left} left: {refused.code}")': ": budget_exceeded",
    "tokenward pricing import sheet.csv --format sheet --source https://example.com/our-contract.pdf "
    "-o prices/negotiated.yaml": "wrote 1 entries to prices/negotiated.yaml",
}
"""What some examples must print (so that running is not all they must do): a shell command
(without its comment) or a line of a Python block, and a fragment of its output."""


@dataclass(frozen=True, slots=True)
class Example:
    kind: str  # sh, python, yaml, json, text
    text: str
    line: int


def readme_examples(text: str) -> list[Example]:
    """Fenced blocks by language, and each shell command of the 4-space indented blocks (``\\`` joined)."""
    examples: list[Example] = []
    lines = text.splitlines()
    index = 0
    previous_blank = True
    while index < len(lines):
        line = lines[index]
        fence = re.match(r"^```(\w*)$", line)
        if fence:
            end = lines.index("```", index + 1)
            examples.append(Example(fence.group(1) or "text", "\n".join(lines[index + 1 : end]), index + 1))
            index, previous_blank = end + 1, False
            continue
        if line.startswith("    ") and previous_blank:
            while index < len(lines) and (lines[index].startswith("    ") or not lines[index].strip()):
                start = index
                command = lines[index].strip()
                while command.endswith("\\"):
                    index += 1
                    command = command[:-1].rstrip() + " " + lines[index].strip()
                if command:
                    examples.append(Example("sh", command, start + 1))
                index += 1
            previous_blank = True
            continue
        previous_blank = not line.strip()
        index += 1
    return examples


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            pass
        assert process.poll() is None, f"{what} exited with {process.returncode}"
        assert time.monotonic() < deadline, f"{what} did not listen on {port}"
        time.sleep(0.1)


def test_the_parser_finds_commands_blocks_and_continuations():
    text = "intro\n\n    a --x \\\n        --y\n    b &\n\n```python\nprint(1)\n```\n\n  - item\n    continued\n"
    assert readme_examples(text) == [
        Example("sh", "a --x --y", 3),
        Example("sh", "b &", 5),
        Example("python", "print(1)", 7),
    ]


def test_every_readme_example_runs(tmp_path):
    examples = readme_examples(README.read_text(encoding="utf-8"))
    assert len([e for e in examples if e.kind == "sh"]) > 30
    assert examples[0].kind == "sh" and examples[0].text.startswith("make run")
    first_python = next(e for e in examples if e.kind == "python")
    assert "127.0.0.1:4000" in first_python.text and "sk-anything" in first_python.text  # the simulator one

    (tmp_path / "config.example.yaml").write_text((ROOT / "config.example.yaml").read_text(encoding="utf-8"))
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # the virtual environment running this test
    for name, content in INPUT_FILES.items():
        (tmp_path / name).write_text(content)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env = {k: v for k, v in env.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "SMTP_", "SLACK_"))}
    env["OPENAI_API_KEY"] = "sk-readme-test"  # "your OPENAI_API_KEY still works": here it reaches the simulator
    scratch = tmp_path / "tmp"  # the examples' own temporary directory, to see what they leave behind
    scratch.mkdir()
    env["TMPDIR"] = str(scratch)
    ports = {"4000": str(free_port()), "9100": str(free_port())}
    replace = {
        "127.0.0.1:4000": f"127.0.0.1:{ports['4000']}",
        "--port 4000": f"--port {ports['4000']}",
        "127.0.0.1:9100": f"127.0.0.1:{ports['9100']}",
        "--port 9100": f"--port {ports['9100']}",
    }
    assert set(replace) | {"<request id>"} == set(SUBSTITUTIONS)
    used_exemptions: set[str] = set()
    seen_expectations: set[str] = set()
    servers: list[subprocess.Popen[bytes]] = []
    healthz_keys: set[str] | None = None

    def substitute(text: str) -> str:
        for old, new in replace.items():
            text = text.replace(old, new)
        if "<request id>" in text:
            export = subprocess.run(
                ["tokenward", "export", "--format", "jsonl"], cwd=tmp_path, env=env, capture_output=True, text=True
            )
            first = json.loads(export.stdout.splitlines()[0])
            assert first["served_model"] == "gpt-4o-mini", export.stdout
            text = text.replace("<request id>", first["request_id"])
        return text

    try:
        for example in examples:
            where = f"README.md line {example.line}: {example.text[:80]}"
            exempt = next((start for start in EXEMPT if example.text.startswith(start)), None)
            if exempt is not None:
                used_exemptions.add(exempt)
                continue
            if example.kind == "sh" and example.text.endswith("&"):
                command = substitute(example.text[:-1].strip())
                port = int(re.search(r"--port (\d+)", command).group(1))
                servers.append(
                    subprocess.Popen(
                        ["bash", "-c", command],
                        cwd=tmp_path,
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
                wait_for_port(port, servers[-1], where)
                continue
            if example.kind == "sh":
                run = ["bash", "-c", substitute(example.text)]
            elif example.kind == "python":
                run = [sys.executable, "-c", substitute(example.text)]
            elif example.kind == "yaml":
                check_yaml(example.text, tmp_path)
                continue
            elif example.kind == "json":
                document = json.loads(example.text)
                if "writable" in document:
                    healthz_keys = set(document)
                continue
            else:
                continue  # text: output shown, not run
            result = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
            output = result.stdout + result.stderr
            assert result.returncode == 0, f"{where}\n{output}"
            assert "Traceback" not in output, f"{where}\n{output}"
            command = re.sub(r"\s+#.*$", "", example.text)
            for start, fragment in EXPECT.items():
                if start == command or (example.kind == "python" and start in example.text):
                    seen_expectations.add(start)
                    assert fragment in result.stdout, f"{where}: expected {fragment!r} in\n{result.stdout}"
        assert servers, "the README starts the simulator and the proxy"
        health = httpx.get(f"http://127.0.0.1:{ports['4000']}/healthz").json()
        assert healthz_keys == set(health), "the README's /healthz example shows other fields than /healthz returns"
    finally:
        for server in servers:
            try:
                os.killpg(server.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        for server in servers:
            server.wait(timeout=30)
    assert used_exemptions == set(EXEMPT), f"exemptions matching no README line: {set(EXEMPT) - used_exemptions}"
    assert seen_expectations == set(EXPECT), f"expectations matching no README line: {set(EXPECT) - seen_expectations}"
    assert list(scratch.iterdir()) == [], "the demo left its temporary ledger behind"
    assert (tmp_path / "spend.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert (tmp_path / "prices" / "negotiated.yaml").exists() and (tmp_path / "requests.jsonl").exists()


def check_yaml(text: str, directory: Path) -> None:
    """A README YAML block is a config fragment (budgets, alerts) or a price file."""
    document = yaml.safe_load(text)
    if "entries" in document:
        path = directory / "readme-prices.yaml"
        path.write_text(text)
        catalog = load_catalog([str(path)])
        assert any(entry.model == "mistral-large-latest" for entry in catalog.entries.values())
        return
    path = directory / "readme-config.yaml"
    upstreams = "" if "upstreams" in document else "upstreams: [{name: a, base_url: 'http://127.0.0.1:9/v1'}]\n"
    path.write_text(upstreams + text)  # a fragment, or a whole config
    config = load_config(path)  # every fragment is valid configuration
    if "budgets" in document:
        assert config.budgets and len(config.budgets) == len(document["budgets"]), text[:40]
    if "alerts" in document:
        assert config.alerts.smtp is not None, text[:40]
    if "virtual_keys" in document:
        assert [k.name for k in config.virtual_keys] == [k["name"] for k in document["virtual_keys"]], text[:40]
