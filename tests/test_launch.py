"""Managed engine lifecycle (with the fake server as the launch command), multi-node wrapper."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import fake_sglang
import pytest

from tokenmill import engines
from tokenmill import model as model_files
from tokenmill import redaction as secrets
from tokenmill.engines import launch as eng

VERSIONS = ["0.5.23", "0.5.16"]


def _gen(*flags, model="fake/model", **launch):
    cmd = ["{python}", fake_sglang.FAKE, "--model-path", "{model}", "--host", "{host}"]
    cmd += ["--port", "{port}", *flags]
    return {
        "model": model,
        "launch": {"command": cmd, "host": "127.0.0.1", "startup_timeout_s": 20, **launch},
    }


@pytest.fixture(autouse=True)
def _digest_cache(tmp_path, monkeypatch):
    """Every test gets its own weight-digest cache (never the user's ~/.cache/tokenmill)."""
    monkeypatch.setenv(model_files.CACHE_ENV, str(tmp_path / "digest-cache"))


@pytest.fixture
def reads(monkeypatch):
    """The files whose bytes the model check hashed (model.hash_file is its only reader)."""
    seen: list[str] = []
    real = model_files.hash_file

    def counting(path):
        seen.append(str(path))
        return real(path)

    monkeypatch.setattr(model_files, "hash_file", counting)
    return seen


def _model_dir(path, weights=b"w" * 300_000, vocab=720):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab, "model_type": "qwen2"}))
    (path / "model.safetensors").write_bytes(weights)
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("version", VERSIONS)
def test_start_check_model_and_stop(tmp_path, version):
    e = eng.ManagedEngine(_gen("--sglang-version", version), tmp_path / "logs")
    asyncio.run(e.start())
    try:
        assert e.alive() and e.url.startswith("http://127.0.0.1:")
        assert e.model_info["model_path"] == "fake/model"
        assert ("served_model_name" in e.model_info) == (version == "0.5.23")
        assert e.server_info["version"] == version
        assert e.model_check == "the server reports 'fake/model'"
        pid = e.proc.pid
    finally:
        e.stop(grace_s=5)
    assert not _pid_alive(pid)
    log = (tmp_path / "logs" / "engine.log").read_text()
    assert "engine start #1" in log and "engine stopped" in log


def test_a_server_already_on_the_engines_port_is_not_taken_for_the_engine(tmp_path, monkeypatch):
    """Between free_port() and the engine's own bind (minutes on a GPU node, after the weights
    load) another process can take the port. That server, here serving the same model, would
    answer the readiness check in the engine's place. The launcher sees a listener older than
    its engine, stops the engine and starts it again on another port."""
    taken = eng.free_port()
    other = fake_sglang.start(taken)
    picks, real = iter([taken]), eng.free_port
    monkeypatch.setattr(eng, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
    e = eng.ManagedEngine(_gen(), tmp_path / "logs")
    try:
        asyncio.run(e.start())
        assert e.alive() and e.port != taken and e.url == f"http://127.0.0.1:{e.port}"
        assert e.starts == 2
        # the server that answers now is the engine's: its own process listens there
        assert eng.older_listener(e.port, e.started_ticks) is None
    finally:
        e.stop(grace_s=5)
        other.kill()
        other.wait(timeout=10)
    log = (tmp_path / "logs" / "engine.log").read_text()
    assert f"port {taken} was taken by pid {other.pid} (" in log, log
    assert "engine start #2" in log


def test_exit_at_start_fails_fast_with_log_tail(tmp_path):
    e = eng.ManagedEngine(_gen("--exit-at-start", "7"), tmp_path)
    t0 = time.monotonic()
    with pytest.raises(eng.EngineError, match=r"(?s)code 7.*failing at start"):
        asyncio.run(e.start())
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("version", VERSIONS)
def test_wrong_model_is_refused(tmp_path, version):
    gen = _gen("--sglang-version", version)
    gen["launch"]["command"][3] = "other/model"
    e = eng.ManagedEngine(gen, tmp_path)
    with pytest.raises(eng.EngineError, match=r"reports \['other/model'\].*'fake/model'"):
        asyncio.run(e.start())
    assert e.proc is None


def test_same_weights_under_another_path_pass_other_weights_fail(tmp_path, caplog):
    here = _model_dir(tmp_path / "models" / "tiny")
    copy = tmp_path / "mnt" / "gpu07" / "tiny"
    shutil.copytree(here, copy)
    gen = {"model": "models/tiny"}
    # 0.5.16: /model_info has only model_path; the server's path is readable from the job
    how = eng.check_model({"model_path": str(copy)}, {}, gen, tmp_path)
    assert "same config.json and weight files" in how
    # a fine-tune of the same base: same config, same size, other bytes
    tuned = _model_dir(tmp_path / "ft" / "tiny", weights=b"v" * 300_000)
    with pytest.raises(eng.EngineError, match=r"(?s)'models/tiny'.*holds other weights"):
        eng.check_model({"model_path": str(tuned)}, {}, gen, tmp_path)
    # another mount point that the job cannot read: the name is all there is, and it says so
    with caplog.at_level("WARNING", logger=eng.log.name):
        how = eng.check_model({"model_path": "/gpfs/ckpt/tiny"}, {}, gen, tmp_path)
    assert "by name" in how
    assert "'/gpfs/ckpt/tiny' is not readable here" in caplog.text
    assert "weights are not compared" in caplog.text
    with pytest.raises(eng.EngineError, match="generation.server_model"):
        eng.check_model({"model_path": "/gpfs/ckpt/other"}, {}, gen, tmp_path)
    # /server_info's arguments count too (0.5.16 has served_model_name only there)
    how = eng.check_model({"model_path": "/x/y"}, {"served_model_name": "models/tiny"}, gen, ".")
    assert "reports 'models/tiny'" in how


@pytest.mark.parametrize("offset", [0, 70_000, 150_000, 299_999])
def test_one_changed_weight_byte_anywhere_is_refused_naming_both_sides(tmp_path, offset):
    """Issue 19 item 8: 64 KiB samples at the middle and the end missed a changed embedding
    table; the check now hashes every byte (offsets 0 and 70,000 lay outside those samples)."""
    weights = bytes(range(256)) * 1172  # 300,032 bytes
    here = _model_dir(tmp_path / "models" / "tiny", weights=weights)
    copy = tmp_path / "mnt" / "copy"
    shutil.copytree(here, copy)
    edited = bytearray(weights)
    edited[offset] ^= 0xFF
    (copy / "model.safetensors").write_bytes(bytes(edited))
    with pytest.raises(eng.EngineError) as err:
        eng.check_model({"model_path": str(copy)}, {}, {"model": "models/tiny"}, tmp_path)
    msg = str(err.value)
    assert str(copy) in msg and "'models/tiny'" in msg and str(here.resolve()) in msg, msg
    assert "model.safetensors differs: sha256" in msg, msg


def test_an_unchanged_copy_is_accepted_and_a_second_job_reads_nothing(tmp_path, reads):
    here = _model_dir(tmp_path / "models" / "tiny")
    copy = tmp_path / "mnt" / "copy"
    shutil.copytree(here, copy)
    gen = {"model": "models/tiny"}
    how = eng.check_model({"model_path": str(copy)}, {}, gen, tmp_path)
    assert "same config.json and weight files" in how and "full content" in how
    assert len(reads) == 4  # config.json and model.safetensors, on both sides
    entries = sorted((tmp_path / "digest-cache" / "sha256").glob("*.json"))
    assert len(entries) == 4
    assert {json.loads(e.read_text())["size"] for e in entries} == {
        300_000,
        (here / "config.json").stat().st_size,
    }
    # A second job is another process: its check takes every digest from the cache and would
    # fail if it read a single weight byte.
    code = (
        "import sys; from tokenmill import model; from tokenmill.engines import launch\n"
        "def no(p): sys.exit(f'read {p}')\n"
        "model.hash_file = no\n"
        f"print(launch.check_model({{'model_path': {str(copy)!r}}}, {{}}, "
        f"{{'model': 'models/tiny'}}, {str(tmp_path)!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={**os.environ, model_files.CACHE_ENV: str(tmp_path / "digest-cache")},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "same config.json and weight files" in out.stdout
    assert len(reads) == 4  # nothing more read in this process either


def test_a_changed_mtime_or_size_is_read_again(tmp_path, reads):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 1000)
    first = model_files.file_sha256(f)
    assert first[1] == "read" and model_files.file_sha256(f) == (first[0], "cache")
    assert len(reads) == 1
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert model_files.file_sha256(f) == (first[0], "read")
    f.write_bytes(b"a" * 1001)
    digest, how = model_files.file_sha256(f)
    assert how == "read" and digest != first[0] and len(reads) == 3
    # an entry whose record does not match its key (another file, a torn write) is not used
    entry = next(p for p in (tmp_path / "digest-cache" / "sha256").glob("*.json")
                 if json.loads(p.read_text())["size"] == 1001)  # fmt: skip
    entry.write_text("{")
    assert model_files.file_sha256(f) == (digest, "read")


def test_an_unwritable_cache_is_skipped(tmp_path, monkeypatch, reads):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(model_files.CACHE_ENV, str(blocker / "cache"))
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 10)
    assert model_files.file_sha256(f)[1] == "read"
    assert model_files.file_sha256(f)[1] == "read" and len(reads) == 2


def test_a_hub_cache_snapshot_gives_its_digests_by_blob_name(tmp_path, reads):
    """A hub snapshot's LFS file links to blobs/<sha256>: that name is the digest, unread."""
    weights = b"h" * 200_000
    copy = _model_dir(tmp_path / "models" / "tiny", weights=weights)
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)

    def blob(name, data, sha):
        (repo / "blobs" / sha).write_bytes(data)
        (snap / name).symlink_to(f"../../blobs/{sha}")

    sha = hashlib.sha256(weights).hexdigest()
    blob("model.safetensors", weights, sha)
    cfg = (copy / "config.json").read_bytes()
    blob("config.json", cfg, hashlib.sha1(cfg).hexdigest())  # a git blob: named by sha1, read
    how = eng.check_model({"model_path": str(snap)}, {}, {"model": "models/tiny"}, tmp_path)
    assert "same config.json and weight files" in how
    assert str(snap / "model.safetensors") not in reads
    assert sorted(reads) == sorted(
        [str(copy.resolve() / "config.json"), str(copy.resolve() / "model.safetensors"),
         str(repo / "blobs" / hashlib.sha1(cfg).hexdigest())]
    )  # fmt: skip
    assert model_files.file_sha256(snap / "model.safetensors") == (sha, "hub blob")
    # the name is trusted: a blob named for other content stands for that content
    (snap / "model.safetensors").unlink()
    blob("model.safetensors", weights, "0" * 64)
    with pytest.raises(eng.EngineError, match=r"model.safetensors differs: sha256"):
        eng.check_model({"model_path": str(snap)}, {}, {"model": "models/tiny"}, tmp_path)


def test_other_files_or_sizes_are_refused_without_reading(tmp_path, reads):
    here = _model_dir(tmp_path / "models" / "tiny")
    shorter = _model_dir(tmp_path / "a" / "tiny", weights=b"w" * 299_999)
    with pytest.raises(eng.EngineError, match=r"model.safetensors differs: 300000 bytes in"):
        eng.check_model({"model_path": str(shorter)}, {}, {"model": "models/tiny"}, tmp_path)
    extra = tmp_path / "b" / "tiny"
    shutil.copytree(here, extra)
    (extra / "lora.safetensors").write_bytes(b"l")
    with pytest.raises(eng.EngineError, match=r"other weight files .*\['lora.safetensors'\]"):
        eng.check_model({"model_path": str(extra)}, {}, {"model": "models/tiny"}, tmp_path)
    nocfg = tmp_path / "c" / "tiny"
    shutil.copytree(here, nocfg)
    (nocfg / "config.json").unlink()
    with pytest.raises(eng.EngineError, match=r"cannot be compared .*no config.json"):
        eng.check_model({"model_path": str(nocfg)}, {}, {"model": "models/tiny"}, tmp_path)
    assert reads == []


def test_a_managed_engine_on_a_changed_copy_is_stopped_and_refused(tmp_path):
    here = _model_dir(tmp_path / "models" / "tiny")
    copy = tmp_path / "copy"
    shutil.copytree(here, copy)
    gen = _gen("--sglang-version", "0.5.16", model="models/tiny")
    gen["launch"]["command"][3] = str(copy)  # the server is started on the copy
    e = eng.ManagedEngine(gen, tmp_path / "ok", basedir=tmp_path)
    asyncio.run(e.start())
    e.stop(grace_s=5)
    assert "same config.json and weight files" in e.model_check
    with open(copy / "model.safetensors", "r+b") as f:
        f.write(b"\0")  # the first byte
    e = eng.ManagedEngine(gen, tmp_path / "bad", basedir=tmp_path)
    with pytest.raises(eng.EngineError, match=r"(?s)'models/tiny'.*model.safetensors differs"):
        asyncio.run(e.start())
    assert e.proc is None


def test_concurrent_checks_share_one_valid_cache_entry(tmp_path, reads):
    from concurrent.futures import ThreadPoolExecutor

    f = tmp_path / "w.safetensors"
    f.write_bytes(os.urandom(1 << 20))
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: model_files.file_sha256(f)[0], range(8)))
    assert set(got) == {hashlib.sha256(f.read_bytes()).hexdigest()}
    files = list((tmp_path / "digest-cache" / "sha256").iterdir())
    assert len(files) == 1 and json.loads(files[0].read_text())["sha256"] == got[0]
    assert model_files.file_sha256(f) == (got[0], "cache")


def test_hub_ids_and_hugging_face_cache_paths():
    gen = {"model": "moonshotai/Kimi-K2.5"}
    snap = "/root/.cache/huggingface/hub/models--moonshotai--Kimi-K2.5/snapshots/0123abc"
    assert "hub model" in eng.check_model({"model_path": snap}, {}, gen)
    assert "by name" in eng.check_model({"model_path": "/models/Kimi-K2.5"}, {}, gen)
    for other in ("moonshotai/Kimi-K2", "/models/Kimi-K2", "Qwen/Kimi-K2.5"):
        with pytest.raises(eng.EngineError, match=r"reports \[.*generation.model is"):
            eng.check_model({"model_path": other}, {}, gen)
    with pytest.raises(eng.EngineError, match="revision"):
        eng.check_model({"model_path": snap}, {"revision": "v2"}, {**gen, "revision": "v1"})


def test_server_model_key_states_the_name():
    gen = {"model": "/local/kimi", "server_model": "kimi-prod"}
    assert "server_model" in eng.check_model({"model_path": "/a", "served_model_name": "kimi-prod"},
                                             {}, gen)  # fmt: skip
    with pytest.raises(eng.EngineError, match=r"server_model is 'kimi-prod': they differ"):
        eng.check_model({"model_path": "/local/kimi"}, {}, gen)


def test_external_0_5_16_from_another_path_is_accepted(tmp_path):
    """The issue's case: an external 0.5.16 server started from a copy of the weights."""
    here = _model_dir(tmp_path / "models" / "tiny")
    copy = tmp_path / "snapshot"
    shutil.copytree(here, copy)
    port = eng.free_port()
    proc = fake_sglang.start(port, "--sglang-version", "0.5.16", model=str(copy))
    try:
        gen = {"model": "models/tiny", "external": {"urls": [f"http://127.0.0.1:{port}"]}}
        ext = eng.ExternalEngines(gen, basedir=tmp_path)
        asyncio.run(ext.start())
        assert "same config.json" in ext.model_check[f"http://127.0.0.1:{port}"]
        bad = eng.ExternalEngines({**gen, "model": "other/model"}, basedir=tmp_path)
        with pytest.raises(eng.EngineError, match=rf"127.0.0.1:{port}: .*other/model"):
            asyncio.run(bad.start())
        # the same server's files with one byte changed (same size, same names): refused
        with open(copy / "model.safetensors", "r+b") as f:
            f.seek(1234)
            f.write(b"x")
        ext = eng.ExternalEngines(gen, basedir=tmp_path)
        with pytest.raises(eng.EngineError) as err:
            asyncio.run(ext.start())
        msg = str(err.value)
        assert f"127.0.0.1:{port}" in msg and str(copy) in msg and "'models/tiny'" in msg
        assert "model.safetensors differs: sha256" in msg
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_model_vocab_size(tmp_path):
    from tokenmill.model import model_vocab_size

    _model_dir(tmp_path / "m", vocab=123)
    assert model_vocab_size("m", tmp_path) == (123, str(tmp_path / "m" / "config.json"))
    (tmp_path / "mm").mkdir()
    (tmp_path / "mm" / "config.json").write_text('{"text_config": {"vocab_size": 9}}')
    assert model_vocab_size("mm", tmp_path)[0] == 9
    assert model_vocab_size("nobody/nothing", tmp_path)[0] is None


@pytest.mark.parametrize("version", VERSIONS)
def test_seed_policy_per_sample_needs_deterministic_inference(tmp_path, version):
    gen = _gen("--sglang-version", version)
    gen.update(seed_policy="per_sample", sampling={"max_new_tokens": 8})
    e = eng.ManagedEngine(gen, tmp_path / "a")
    with pytest.raises(eng.EngineError, match=r"--enable-deterministic-inference.*allow_ignored"):
        asyncio.run(e.start())
    assert e.proc is None  # stopped
    e = eng.ManagedEngine({**gen, "allow_ignored_seeds": True}, tmp_path / "b")
    asyncio.run(e.start())
    e.stop(grace_s=5)
    assert e.notes["seeds_honoured"] is False
    gen["launch"]["command"].append("--enable-deterministic-inference")
    e = eng.ManagedEngine(gen, tmp_path / "c")
    asyncio.run(e.start())
    e.stop(grace_s=5)
    assert e.notes["seeds_honoured"] is True


def test_sampling_key_the_running_version_refuses_is_refused_at_start(tmp_path):
    counter = tmp_path / "req.jsonl"
    gen = _gen("--sglang-version", "0.5.16", "--counter-file", str(counter))
    gen["sampling"] = {"max_new_tokens": 8, "watermark": {"gamma": 0.25}}
    with pytest.raises(eng.EngineError, match=r"sampling.watermark: not accepted by SGLang 0.5.16"):
        asyncio.run(eng.ManagedEngine(gen, tmp_path).start())
    assert fake_sglang.count_requests(counter) == 0
    gen = _gen("--sglang-version", "0.5.23")
    gen["sampling"] = {"max_new_tokens": 8, "watermark": {"gamma": 0.25}}
    e = eng.ManagedEngine(gen, tmp_path / "new")
    asyncio.run(e.start())
    e.stop(grace_s=5)


def test_config_check_wants_the_deterministic_flag_when_it_can_see_the_launch():
    sgl = ["python", "-m", "sglang.launch_server", "--model-path", "{model}"]
    gen = {"mode": "managed", "seed_policy": "per_sample", "launch": {"command": sgl}}
    with pytest.raises(ValueError, match="enable-deterministic-inference"):
        engines.validate_launch(gen)
    engines.validate_launch({**gen, "allow_ignored_seeds": True})
    engines.validate_launch(
        {**gen, "launch": {"command": [*sgl, "--enable-deterministic-inference"]}}
    )
    engines.validate_launch({**gen, "launch": {"command": ["bash", "start_server.sh"]}})
    engines.validate_launch({**gen, "seed_policy": "none"})


def test_local_model_path_compared_by_realpath(tmp_path):
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    os.symlink(tmp_path / "models" / "tiny", tmp_path / "link")
    assert eng.model_matches({"model_path": str(tmp_path / "link")}, "models/tiny", tmp_path)
    assert not eng.model_matches({"model_path": "/elsewhere"}, "models/tiny", tmp_path)


def test_startup_timeout(tmp_path):
    e = eng.ManagedEngine(_gen("--startup-delay", "60", startup_timeout_s=1), tmp_path)
    with pytest.raises(eng.EngineError, match="not ready after"):
        asyncio.run(e.start())
    assert e.proc is None


def test_redaction():
    info = {
        "api_key": "K1",
        "hf_token": "x",
        "max_total_num_tokens": 5,
        "tokenizer_path": "t",
        "launch_command": "serve --api-key K1 --port 1",
        "nested": [{"db_password": "p"}],
    }
    out = secrets.redact(info, ["K1"])
    assert out["api_key"] == out["hf_token"] == out["nested"][0]["db_password"] == "<redacted>"
    assert out["max_total_num_tokens"] == 5 and out["tokenizer_path"] == "t"
    assert "K1" not in json.dumps(out)
    argv = ["serve", "--api-key", "K1", "--admin-api-key=K2", "--x=K1", "--port", "1"]
    assert secrets.redact_argv(argv, ["K1"]) == [
        "serve",
        "--api-key",
        "<redacted>",
        "--admin-api-key=<redacted>",
        "--x=<redacted>",
        "--port",
        "1",
    ]


def test_expand_nodelist(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the built-in parser
    assert eng.expand_nodelist("gpu[07-09,12],login1") == [
        "gpu07",
        "gpu08",
        "gpu09",
        "gpu12",
        "login1",
    ]
    assert eng.expand_nodelist("node1") == ["node1"]


def test_task_wrapper_substitutes_rank_and_head(tmp_path):
    template = [sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))"]
    template += ["--node-rank", "{node_rank}", "--dist-init-addr", "{dist_init_addr}"]
    env = dict(os.environ, SLURM_PROCID="1", SLURM_NODEID="1", SLURM_JOB_NODELIST="gpu[07-08]")
    env["PATH"] = os.path.dirname(sys.executable)  # no scontrol here
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.engines.launch",
            "task",
            "--argv-json",
            json.dumps(template),
        ]
        + ["--dist-port", "5000"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert json.loads(out) == ["--node-rank", "1", "--dist-init-addr", "gpu07:5000"]


def test_multinode_launch_with_injected_prefix(tmp_path, monkeypatch):
    # A local stand-in for srun: one task (rank 0) with fake SLURM variables.
    monkeypatch.setenv("SLURM_JOB_NODELIST", "127.0.0.1")
    gen = _gen("--nnodes", "{nnodes}", "--node-rank", "{node_rank}")
    gen["launch"]["command"] += ["--dist-init-addr", "{dist_init_addr}"]
    gen["launch"]["nnodes"] = 2
    launcher = ["env", "SLURM_PROCID=0", "SLURM_NODEID=0", "SLURM_JOB_NODELIST=127.0.0.1"]
    gen["launch"]["launcher"] = launcher
    e = eng.ManagedEngine(gen, tmp_path)
    argv = e.build_argv(31000)
    assert argv[:4] == ["env", "SLURM_PROCID=0", "SLURM_NODEID=0", "SLURM_JOB_NODELIST=127.0.0.1"]
    assert argv[4:8] == [sys.executable, "-m", "tokenmill.engines.launch", "task"]
    asyncio.run(e.start())
    try:
        launched = e.server_info["launch_command"]
        port = int(e.url.rsplit(":", 1)[1])
        assert "--nnodes 2 --node-rank 0" in launched
        assert e.dist_port >= port + eng.DIST_PORT_OFFSET  # the first free block from there
        assert f"--dist-init-addr 127.0.0.1:{e.dist_port}" in launched
    finally:
        e.stop(grace_s=5)


def test_engine_srun_gets_a_clean_slurm_environment(tmp_path, monkeypatch):
    """What the rule's one-node step leaves in the environment (SLURM_JOB_NODELIST=n1, ...)
    must not reach the engine's srun; the job's identity does."""
    dump = tmp_path / "env.json"
    shim = f"import json, os, sys; json.dump(dict(os.environ), open({str(dump)!r}, 'w'));"
    shim += " os.execvp(sys.argv[1], sys.argv[1:])"
    step = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_NODELIST": "127.0.0.1",
            "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SLURM_CPUS_PER_TASK": "2",
            "SRUN_DEBUG": "3", "SBATCH_EXPORT": "ALL", "SLURM_CONF": "/etc/slurm/x.conf",
            "SLURM_SUBMIT_DIR": "/w", "SLURM_PROCID": "0"}  # fmt: skip
    for k, v in step.items():
        monkeypatch.setenv(k, v)
    gen = _gen("--nnodes", "{nnodes}", "--node-rank", "{node_rank}")
    gen["launch"]["nnodes"] = 2
    gen["launch"]["launcher"] = [sys.executable, "-c", shim]
    e = eng.ManagedEngine(gen, tmp_path)
    asyncio.run(e.start())
    e.stop(grace_s=5)
    got = json.loads(dump.read_text())
    slurm = {k: v for k, v in got.items() if k.startswith(("SLURM_", "SRUN_", "SBATCH_"))}
    assert slurm == {
        "SLURM_JOB_ID": "7",
        "SLURM_CONF": "/etc/slurm/x.conf",
        "SLURM_SUBMIT_DIR": "/w",
    }
    assert got["PATH"] == os.environ["PATH"]  # everything else passes through


def test_busy_port_block_is_skipped():
    base = eng.free_port_block(42000)
    busy = socket.socket()
    busy.bind(("", base + 3))  # one port inside the block is taken (bound, as by an engine)
    try:
        assert not eng.ports_free(base)
        got = eng.free_port_block(base)
        assert got >= base + eng.DIST_PORT_SPAN, got  # the whole block skipped
        assert eng.ports_free(got)
    finally:
        busy.close()
    assert eng.ports_free(base)


def test_head_is_the_jobs_first_node_at_its_address(tmp_path, monkeypatch):
    """Inside the rule's step SLURM_JOB_NODELIST is that step's node, SLURM_NODELIST the job's;
    a node name that does not resolve is replaced by SLURM's NodeAddr."""
    assert eng.head_address({"SLURM_NODELIST": "localhost"}) == "localhost"  # resolves
    assert eng.head_address({}) == "127.0.0.1"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = show ]; then echo tm-nores-n1; echo tm-nores-n2; exit 0; fi\n'
        'echo "NodeName=$4 Arch=x86_64 NodeAddr=10.1.2.3 NodeHostName=$4 State=IDLE"\n'
    )
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    env = {"SLURM_JOB_NODELIST": "tm-nores-n2", "SLURM_NODELIST": "tm-nores-n[1-2]"}
    assert eng.head_address(env) == "10.1.2.3"
    assert eng.task_argv(
        ["{dist_init_addr}", "{node_rank}"], {**env, "SLURM_PROCID": "1"}, 5000
    ) == [
        "10.1.2.3:5000",
        "1",
    ]


def test_default_launcher_is_srun():
    assert eng.launcher_prefix(2, ["mpirun", "-np", "2"]) == ["mpirun", "-np", "2"]
    assert eng.launcher_prefix(2) == [
        "srun",
        "--overlap",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]
