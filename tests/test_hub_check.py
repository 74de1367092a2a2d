"""A hub id that does not exist fails before any job, in one line, in seconds.

The hub is a real HTTP server on localhost speaking the Hugging Face API's answers (HF_ENDPOINT
points huggingface_hub at it): 200 with the repository's info, 404 RepoNotFound, 404
RevisionNotFound, 403 GatedRepo, as huggingface.co answers `GET /api/models/<id>`. The run is
started as the README's own-data commands start it, from `env -i` and without HF_HUB_OFFLINE.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from helpers import BIN, copy_workflow

from tokenmill import config as cfg
from tokenmill.settings import Settings

EXISTS = {"models/org/real-model", "datasets/org/real-data"}
GATED = {"models/org/gated-model"}


class FakeHub(BaseHTTPRequestHandler):
    asked: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        FakeHub.asked.append(self.path)
        path = self.path.split("?", 1)[0].removeprefix("/api/")
        repo, _, revision = path.partition("/revision/")
        if repo in GATED:
            return self._answer(403, "GatedRepo", {"error": "gated"})
        if repo not in EXISTS:
            return self._answer(404, "RepoNotFound", {"error": "Repository not found"})
        if revision and revision != "main":
            return self._answer(404, "RevisionNotFound", {"error": "Invalid rev id"})
        self._answer(200, None, {"id": repo.split("/", 1)[1], "sha": "0" * 40, "siblings": []})

    def _answer(self, status, code, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def settings_with(tmp_path: Path, tokenizer: str, revision: str | None = None, sources=None):
    config = yaml.safe_load((Path(__file__).parent.parent / "config.yaml").read_text())
    config["tokenizer"]["path"] = tokenizer
    config["tokenizer"]["revision"] = revision
    if sources is not None:
        config["categories"] = {"chat": {"format": "sharegpt", "sources": sources}}
    cfg.validate_schema(config)
    return Settings.from_validated(config)


def problems(monkeypatch, endpoint: str, settings) -> list[str]:
    from huggingface_hub import constants

    # The suite runs offline; huggingface_hub read that when it was imported.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", "/nonexistent-cache")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", "/nonexistent-cache")
    return cfg.hub_problems(settings, Path(__file__).parent.parent)


def test_each_hub_answer_is_one_line_naming_the_key(hub, monkeypatch, tmp_path):
    FakeHub.asked.clear()
    ok = settings_with(tmp_path, "org/real-model")
    assert problems(monkeypatch, hub, ok) == []
    assert any(a.startswith("/api/models/org/real-model") for a in FakeHub.asked)

    (typo,) = problems(monkeypatch, hub, settings_with(tmp_path, "org/real-modle"))
    assert typo.startswith("config key 'tokenizer.path': hub id 'org/real-modle' does not exist")
    assert "hf auth login" in typo and "\n" not in typo

    (gated,) = problems(monkeypatch, hub, settings_with(tmp_path, "org/gated-model"))
    assert "is gated" in gated and "HF_TOKEN" in gated

    (rev,) = problems(monkeypatch, hub, settings_with(tmp_path, "org/real-model", "v9"))
    assert "at revision 'v9'" in rev and "revision does not exist" in rev

    # A hub dataset source is asked as a dataset, under its own key.
    data = [{"hub": "org/real-data", "split": "train"}, {"hub": "org/no-data", "split": "train"}]
    (missing,) = problems(monkeypatch, hub, settings_with(tmp_path, "org/real-model", None, data))
    assert missing.startswith("config key 'categories.chat.sources[1].hub': hub id 'org/no-data'")
    assert any(a.startswith("/api/datasets/org/real-data") for a in FakeHub.asked)


def test_an_unreachable_hub_names_the_download_command_of_this_venv(monkeypatch, tmp_path):
    with ThreadingHTTPServer(("127.0.0.1", 0), FakeHub) as closed:
        port = closed.server_port  # bound, then closed: nothing listens there
    (line,) = problems(monkeypatch, f"http://127.0.0.1:{port}", settings_with(tmp_path, "o/m"))
    assert "cannot be reached" in line and "HF_HUB_OFFLINE=1" in line
    hf = Path(line.split("network (", 1)[1].split(" ", 1)[0])
    assert hf.name == "hf" and hf.is_file(), line  # the command exists, as printed


def test_offline_asks_nothing_and_the_cache_check_names_hf(monkeypatch, tmp_path, hub):
    FakeHub.asked.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cfg.hub_problems(settings_with(tmp_path, "org/real-modle"), ".") == []
    assert FakeHub.asked == []
    line = cfg.path_problem("tokenizer.path", "org/real-modle", tmp_path)
    assert line and f"{BIN / 'hf'} download org/real-modle" in line


@pytest.mark.e2e
def test_a_hub_typo_stops_the_run_before_any_job_in_one_line(hub, tmp_path):
    run = copy_workflow(tmp_path / "wf")
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["tokenizer"]["path"] = "org/real-modle"
    (run / "my.yaml").write_text(yaml.safe_dump(config))
    FakeHub.asked.clear()
    started = time.monotonic()
    # As the README's own-data command, from a clean environment (no HF_HUB_OFFLINE).
    proc = subprocess.run(
        ["env", "-i", "HOME=" + str(tmp_path), "PATH=/usr/bin:/bin", f"HF_ENDPOINT={hub}",
         f"HF_HOME={tmp_path / 'hf'}", "bash", "-c",
         f"{BIN / 'snakemake'} --profile profiles/local --configfile my.yaml"],
        cwd=run, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "config key 'tokenizer.path': hub id 'org/real-modle' does not exist" in out, out
    assert "Traceback" not in out and len(out.splitlines()) <= 6, out
    assert not (run / "results").exists(), "a job ran"
    assert [a for a in FakeHub.asked if a.startswith("/api/models/")] == [
        "/api/models/org/real-modle"
    ], FakeHub.asked
    print(f"hub typo: exit 1 after {elapsed:.1f} s, {len(out.splitlines())} lines")
