"""A real Prometheus server (Debian's `prometheus` binary) for the end-to-end tests: a child process
on a free loopback port, its config and TSDB in a folder, scraping guards every second and
evaluating rules every second; its HTTP API for queries, alerts and rules."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import yaml
from support import wait_for
from free_ports import free_port

PROMETHEUS = shutil.which("prometheus")


class PrometheusServer:
    """`prometheus` as a child process on a free loopback port, config and TSDB in a folder."""

    def __init__(self, folder: Path, metrics_ports: int | list[int], rules_text: str):
        """``metrics_ports``: the guard(s) to scrape, all in job ``guard``."""
        self.folder = folder
        self.port = free_port()
        ports = [metrics_ports] if isinstance(metrics_ports, int) else list(metrics_ports)
        (folder / "rules.yaml").write_text(rules_text)
        (folder / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(folder / "rules.yaml")],
            "scrape_configs": [{"job_name": "guard", "static_configs": [
                {"targets": [f"127.0.0.1:{port}" for port in ports]}]}],
        }))
        self.log_path = folder / "prometheus.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        wait_for(self._ready, timeout=30, interval=0.1)

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.process.returncode}:\n"
                                 + self.log_path.read_text())
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.process is not None:
            self._log.close()

    def api(self, path: str, **params) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/{path}{query}",
                                    timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def alerts(self, name: str) -> list[dict]:
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == name]

    def rule(self, name: str) -> dict:
        rules = [r for g in self.api("rules")["groups"] for r in g["rules"]
                 if r.get("name") == name]
        assert len(rules) == 1, rules
        return rules[0]
