"""A server in a subprocess, for the serving benchmark, the soak script and the tests: start it on a
free port, read its URL, scrape its metrics, read its resident memory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from .metrics import PREFIX


def serve_command(*args: str) -> list[str]:
    """`compiled-mtp serve ARGS` on a free port, with this Python."""
    return [sys.executable, "-m", "compiled_mtp.cli", "serve", "--port", "0", *args]


def start(command: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Run a serve command (its stderr passes through; `env` adds to the environment); returns the
    process and its base URL once it listens. Raises RuntimeError, with the output so far, when it
    exits first."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=os.environ | (env or {}))
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        match = re.search(r"serving \S+ on (http://\S+)/v1 ", line)
        if match:
            return proc, match[1]
    proc.wait()
    raise RuntimeError(f"serve exited with {proc.returncode} before listening:\n{''.join(lines)}")


def scrape(url: str, api_key: str | None = None) -> dict[str, float]:
    """The server's metrics, by sample name without the prefix: `num_requests_running`,
    `spec_decode_num_accepted_tokens_total`, `spec_decode_num_accepted_tokens_per_pos_total{position="0"}`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=headers), timeout=30) as r:
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[s.name.removeprefix(PREFIX) + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def resident_bytes(pid: int) -> int:
    """A process's resident memory (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
