"""`tokenmill provenance`: what produced every file of a run, in one JSON manifest.

    tokenmill provenance --results-dir results --config-json CONFIG.json \
        --configfiles config.yaml [...] --out results/provenance.json [--basedir .]
    tokenmill provenance --compare MANIFEST --results-dir NEW_RESULTS --out report.json

Schema "tokenmill.provenance/1" (keys sorted on disk):

    schema            "tokenmill.provenance/1"
    results_dir       the results directory as given
    config            resolved (the resolved config), sha256 (of its canonical JSON),
                      files [{path, size, sha256}] (the --configfiles)
    inputs            {category: [{kind: "file", path, size, sha256}
                                  | {kind: "hub", name, config, split, revision}]},
                      prepare_metadata {category: tokenmill.* metadata of the prompts file,
                      where prepare records hub dataset fingerprints}
    tokenizer         path, revision, trust_remote_code, chat_template, chat_template_kwargs,
                      fingerprints (from tokenized shards), files [{path, size, sha256}]
                      (every file of a local tokenizer directory, and the chat template file)
    model             id, revision, engine
    generation        fingerprint, sampling, stop_tokens, seed_policy, mode,
                      api_key_env (the variable's NAME only, never its value)
    engine            [{category, shard, meta}] the generate job records
                      (contracts.GenerateJobRecord, redacted again)
    jobs              [{stage (generate, hidden_states), category, shard, slurm_job_id, host,
                      nodelist, start, end, attempts, gpu_hours}]: every attempt since the
                      shard's previous record counted
    times             start, end (the first attempt's start, the last record's end)
    software          python, platform, packages {name: version or null}
    workflow          git_commit, dirty (null when basedir is not a git checkout)
    draft_vocab       the draft vocabulary's vocab_mapping.json (draft and target sizes,
                      always-included ids, coverage, sha256 of each file and of each counts
                      file read), or null when the run built none; token_counts {path:
                      loss tokens} of every counts file (results/token_counts/)
    outputs           [{path (relative to results), size, sha256, rows (parquet only)}],
                      every file the config declares (layout.published_files) and every
                      file of the declared hidden-state shard folders and the training
                      folder's rows files (its row files are links to the shards' files)
    generated_samples {path: {prompt_id: sha256(output_ids as little-endian int32)[:16]}}
                      so a rerun can be compared sample by sample
    hidden_states     only when the stage ran (hidden_states.enabled): per shard folder
                      (hidden_states/{category}/{shard}) its rows, tokens, bytes, layer_ids,
                      dtype, layouts and fingerprint; its files are in `outputs` (their sha256
                      taken from the shard's manifest.json when the size agrees)

The dataset folder's own manifest (`--dataset-out results/dataset/provenance.json`, written by
the same command) holds the same keys, so the folder one publishes stands alone: `outputs`
lists the files of the dataset folder (paths relative to it), `run_outputs` the run's
`outputs` above (what a reproduction compares), and `scope` is "dataset".
`tokenmill verify results/dataset` and `tokenmill reproduce-config
results/dataset/provenance.json` read it.

Secrets: values under secret-looking keys (api_key, token, password, secret, authorization)
and after --api-key style flags are replaced by "<redacted>", and the value of the environment
variable named by generation.api_key_env is scrubbed from the whole manifest text.

Reproducing: `check_reproducible(manifest, config, basedir)` lists what differs locally
(tokenizer files, input files, model/revision); `compare_outputs(manifest, results_dir)`
checks that prepare and tokenize outputs are byte-identical and counts identical generated
samples.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
from importlib import metadata as importlib_metadata
from pathlib import Path

import pyarrow.parquet as pq

import tokenmill
from tokenmill import contracts, keys, layout
from tokenmill.contracts import sha256_file
from tokenmill.prepare.sources import expand_paths
from tokenmill.redaction import REDACTED, redact
from tokenmill.settings import ConfigError, Settings, as_settings, load_section

SCHEMA = "tokenmill.provenance/1"
PACKAGES = (
    "tokenmill",
    "snakemake",
    "transformers",
    "tokenizers",
    "pyarrow",
    "datasets",
    "torch",
    "aiohttp",
    "sglang",
    "numpy",
    "jinja2",
)


def file_entry(path, shown=None) -> contracts.FileDigest:
    """A file's path, size and sha256; `shown` is the path to record (default: as given)."""
    p = Path(path)
    return contracts.FileDigest(
        path=str(path) if shown is None else str(shown),
        size=p.stat().st_size,
        sha256=sha256_file(p),
    )


def scrub_text(text: str, config: Settings | dict) -> str:
    """Remove the API key's value (if its env var is set) from serialized text."""
    name = as_settings(config).generation.api_key_env
    secret = os.environ.get(name) if name else None
    if secret:
        text = text.replace(secret, REDACTED)
        text = text.replace(json.dumps(secret)[1:-1], REDACTED)
    return text


def _inputs(config: Settings, basedir: Path) -> dict[str, list]:
    """{category: its sources, as contracts.InputFile and contracts.HubInput}."""
    out = {}
    for cat, spec in sorted(config.categories.items()):
        entries = []
        for s in spec.source_specs():
            if "hub" in s:
                entries.append(
                    contracts.HubInput(
                        kind="hub",
                        name=s["hub"],
                        config=s["config"],
                        split=s["split"],
                        revision=s["revision"],
                    )
                )
                continue
            # The same expansion prepare reads (recursive globs, files only), recorded as the
            # config writes it: relative to the workflow, or absolute (/scratch/..., /data/...).
            for shown, f in expand_paths(s["path"], basedir):
                e = file_entry(f, shown)
                entries.append(contracts.InputFile("file", e.path, e.size, e.sha256))
        out[cat] = entries
    return out


def _tokenizer_files(config: Settings, basedir: Path) -> list[contracts.FileDigest]:
    """Every file of a local tokenizer directory and the chat template file, each recorded
    under the path the config gives (tokenizer.path joined with the file's name inside it), so
    an absolute tokenizer.path such as /models/kimi is recorded as it is."""
    tok = config.tokenizer
    files = []
    local = basedir / tok.path  # an absolute tokenizer.path stays absolute
    if local.is_dir():
        shown = Path(tok.path)
        files += [
            file_entry(p, (shown / p.relative_to(local)).as_posix())
            for p in sorted(local.rglob("*"))
            if p.is_file()
        ]
    if tok.chat_template and (basedir / tok.chat_template).is_file():
        files.append(file_entry(basedir / tok.chat_template, tok.chat_template))
    return files


def _git(basedir: Path) -> contracts.WorkflowProvenance:
    def run(*args):
        try:
            r = subprocess.run(
                ["git", "-C", str(basedir), *args], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = run("rev-parse", "HEAD")
    status = run("status", "--porcelain") if commit else None
    return contracts.WorkflowProvenance(
        git_commit=commit, dirty=None if status is None else bool(status)
    )


def _version(package: str) -> str | None:
    # tokenmill: the code that ran says its version (the rules import it from the workflow's
    # folder, installed or not; an installed copy's metadata may be another checkout's).
    if package == "tokenmill":
        return tokenmill.__version__
    try:
        return importlib_metadata.version(package)
    except importlib_metadata.PackageNotFoundError:
        return None


def _software() -> dict:
    pkgs = {name: _version(name) for name in PACKAGES}
    return {"python": sys.version.split()[0], "platform": platform.platform(), "packages": pkgs}


# The dataset folder's own manifest: written with provenance.json, listed by neither.
DATASET_DIR = layout.DATASET_DIR
MANIFEST_NAME = layout.PROVENANCE


def output_paths(results: Path, config: Settings | dict) -> list[str]:
    """Paths (relative to results, posix) of the files the provenance lists: every file the
    config declares (layout.published_files), never what else lies in the folder."""
    config = as_settings(config)
    lay = layout.Layout(str(results), config.journal_dir)
    return [Path(p).relative_to(results).as_posix() for p in layout.published_files(lay, config)]


def _hidden_states_manifests(results: Path, config: Settings) -> dict:
    """{shard folder (relative): its contracts.HiddenStatesManifest} of the hidden_states
    stage's declared shards."""
    if not config.hidden_states.enabled:
        return {}
    lay = layout.Layout(str(results), config.journal_dir)
    out = {}
    for c, shards in layout.declared(config).items():
        for s in shards:
            folder = Path(lay.hidden_states_dir(c, s))
            out[folder.relative_to(results).as_posix()] = contracts.HiddenStatesManifest.read(
                lay.hidden_states_manifest(c, s)
            )
    return out


def _training_rows_files(results: Path, config: Settings) -> dict:
    """{path: ManifestFile} of the training folders' rows files (the run's, each category's;
    their row files are links into the shard folders, listed there; verify checks each
    link)."""
    lay = layout.Layout(str(results), config.journal_dir)
    out = {}
    for c in layout.training_folders(config):
        m = contracts.HiddenStatesTrainingManifest.read(lay.hidden_states_training_manifest(c))
        folder = Path(lay.hidden_states_training_dir(c)).relative_to(results).as_posix()
        out |= {f"{folder}/{f.path}": f for f in m.rows_files}
    return out


def _job(category: str, shard: str, record, stage: str) -> contracts.JobProvenance:
    """One GPU job's line: where it ran, when, its attempts and their GPU-hours."""
    return contracts.JobProvenance(
        category=category,
        shard=shard,
        slurm_job_id=record.slurm.job_id,
        nodelist=record.slurm.nodelist,
        host=record.host,
        start=record.start_time,
        end=record.end_time,
        attempts=len(record.attempts),
        gpu_hours=round(record.gpu_s / 3600, 6),
        stage=stage,
    )


def _hidden_states(manifests: dict) -> dict[str, contracts.HiddenStatesProvenance]:
    """Per shard folder: rows, tokens, bytes, layer ids, dtype, layouts, the stage fingerprint
    (the row files themselves are in `outputs`)."""
    return {
        d: contracts.HiddenStatesProvenance(
            rows=m.rows, tokens=m.tokens, bytes=m.bytes, layer_ids=m.layer_ids, dtype=m.dtype,
            layouts=m.layouts, fingerprint=m.fingerprint,
        )
        for d, m in manifests.items()
    }  # fmt: skip


def list_outputs(results: Path, config: Settings | dict) -> list[contracts.OutputFile]:
    """{path, size, sha256, rows (Parquet)} of every declared file and every file of the
    declared hidden-state shard folders (their sha256 from the manifest their job wrote from
    the bytes it wrote, when the size on disk agrees: terabytes in a real run; verify
    re-reads)."""
    config = as_settings(config)
    manifests = _hidden_states_manifests(results, config)
    known = {f"{d}/{f.path}": f for d, m in manifests.items() for f in m.files}
    known |= _training_rows_files(results, config)
    entries = []
    for rel in sorted([*output_paths(results, config), *known]):
        p = results / rel
        k = known.get(rel)
        if k and p.stat().st_size == k.size:
            entries.append(contracts.OutputFile(rel, k.size, k.sha256))
            continue
        e = file_entry(p, rel)
        rows = pq.ParquetFile(p).metadata.num_rows if p.suffix == ".parquet" else None
        entries.append(contracts.OutputFile(rel, e.size, e.sha256, rows))
    return entries


def sample_digests(path) -> dict[str, str]:
    """{prompt_id: sha256(output_ids)[:16]} of a generated shard."""
    t = pq.read_table(path, columns=["prompt_id", "output_ids"])
    vals, off = contracts.list_arrays(t.column("output_ids"))
    pids = t.column("prompt_id").to_pylist()
    return {
        pid: hashlib.sha256(vals[off[i] : off[i + 1]].tobytes()).hexdigest()[:16]
        for i, pid in enumerate(pids)
    }


def build(
    results_dir, config: Settings | dict, configfiles=(), basedir=".", out_path=None
) -> contracts.Provenance:
    results, base = Path(results_dir), Path(basedir)
    settings = as_settings(config)
    config = settings.raw  # the resolved config, as recorded
    gen, tok = settings.generation, settings.tokenizer
    lay = layout.Layout(str(results), settings.journal_dir)
    declared = layout.declared(settings)
    engine, jobs, starts, ends = [], [], [], []
    for cat, shard in ((c, s) for c, shards in declared.items() for s in shards):
        record = contracts.GenerateJobRecord.read(lay.generate_record(cat, shard))
        engine.append(contracts.EngineProvenance(cat, shard, redact(record.to_json())))
        starts += [a.started for a in record.attempts]
        ends += [record.end_time]
        jobs.append(_job(cat, shard, record, "generate"))
    if settings.hidden_states.enabled:  # the stage's GPU jobs, after every generate job
        for cat, shard in ((c, s) for c, shards in declared.items() for s in shards):
            record = contracts.HiddenStatesJobRecord.read(lay.hidden_states_record(cat, shard))
            jobs.append(_job(cat, shard, record, "hidden_states"))
    outputs = list_outputs(results, settings)
    tok_fps = sorted(
        {
            contracts.read_metadata(f).get(contracts.META_TOKENIZER_FINGERPRINT)
            for f in (lay.tokenized(c, s) for c, shards in declared.items() for s in shards)
        }
        - {None}
    )
    return contracts.Provenance(
        results_dir=str(results_dir),
        config=contracts.ConfigProvenance(
            resolved=redact(config),
            sha256=hashlib.sha256(contracts.canonical_json(config).encode()).hexdigest(),
            files=[file_entry(f) for f in configfiles],
        ),
        inputs=_inputs(settings, base),
        prepare_metadata={c: dict(contracts.read_metadata(lay.prompts(c))) for c in declared},
        tokenizer=contracts.TokenizerProvenance(
            path=tok.path,
            revision=tok.revision,
            trust_remote_code=tok.trust_remote_code,
            chat_template=tok.chat_template,
            chat_template_kwargs=tok.raw["chat_template_kwargs"],
            fingerprints=tok_fps,
            files=_tokenizer_files(settings, base),
        ),
        model=contracts.ModelProvenance(id=gen.model, revision=gen.revision, engine=gen.engine),
        generation=contracts.GenerationProvenance(
            fingerprint=keys.generation_fingerprint(gen),
            sampling=gen.raw["sampling"],
            stop_tokens=gen.raw["stop_tokens"],
            seed_policy=gen.seed_policy,
            mode=gen.mode,
            api_key_env=gen.api_key_env,
        ),
        engine=engine,
        jobs=jobs,
        times=contracts.RunTimes(
            start=min(starts) if starts else None, end=max(ends) if ends else None
        ),
        software=_software(),
        workflow=_git(base),
        outputs=outputs,
        draft_vocab=_draft_vocab(lay),
        token_counts={
            e.path: int(contracts.read_metadata(results / e.path)[contracts.META_LOSS_TOKENS])
            for e in outputs
            if e.path.startswith(f"{layout.COUNTS_DIR}/") and e.path.endswith(".parquet")
        },
        generated_samples={
            e.path: sample_digests(results / e.path)
            for e in outputs
            if e.path.startswith("generated/") and e.path.endswith(".parquet")
        },
        hidden_states=(
            _hidden_states(_hidden_states_manifests(results, settings))
            if settings.hidden_states.enabled
            else None
        ),
    )


def dataset_manifest(run: contracts.Provenance) -> contracts.Provenance:
    """The dataset folder's manifest: the run's manifest with `outputs` listing the folder's
    own declared files (relative to it) and the run's outputs kept as `run_outputs`."""
    prefix = DATASET_DIR + "/"
    own = [e.replace(path=e.path[len(prefix) :]) for e in run.outputs if e.path.startswith(prefix)]
    return run.replace(scope="dataset", outputs=own, run_outputs=run.outputs)


def _draft_vocab(lay: layout.Layout) -> dict | None:
    path = Path(lay.vocab_mapping_summary())
    return json.loads(path.read_text()) if path.is_file() else None


def dumps(manifest: contracts.Provenance, config: Settings | dict) -> str:
    return scrub_text(json.dumps(manifest.to_json(), indent=2, sort_keys=True), config) + "\n"


def check_reproducible(
    manifest: contracts.Provenance, config: Settings | dict, basedir="."
) -> list[str]:
    """Why this checkout cannot reproduce the manifest's run (empty list: it can)."""
    base = Path(basedir)
    config = as_settings(config)
    problems = []
    want_tok = manifest.tokenizer
    for key in ("path", "revision", "chat_template", "trust_remote_code"):
        want, have = getattr(want_tok, key), getattr(config.tokenizer, key)
        if want != have:
            problems.append(f"tokenizer.{key}: manifest {want!r}, config {have!r}")
    problems += _diff_files("tokenizer file", want_tok.files, _tokenizer_files(config, base))
    have_inputs = _inputs(config, base)
    for cat, want in manifest.inputs.items():
        have = have_inputs.get(cat)
        if have is None:
            problems.append(f"category {cat}: in the manifest, not in the config")
            continue
        problems += _diff_files(
            f"input of {cat}",
            [e for e in want if isinstance(e, contracts.InputFile)],
            [e for e in have if isinstance(e, contracts.InputFile)],
        )
        hub_w = [e.to_json() for e in want if isinstance(e, contracts.HubInput)]
        hub_h = [e.to_json() for e in have if isinstance(e, contracts.HubInput)]
        if hub_w != hub_h:
            problems.append(f"hub sources of {cat}: manifest {hub_w}, config {hub_h}")
    for cat in sorted(set(have_inputs) - set(manifest.inputs)):
        problems.append(f"category {cat}: in the config, not in the manifest")
    model, gen = manifest.model, config.generation
    if model.id != gen.model or model.revision != gen.revision:
        problems.append(
            f"model: manifest {model.id}@{model.revision}, config {gen.model}@{gen.revision}"
        )
    return problems


def _diff_files(what, want: list, have: list) -> list[str]:
    """Problems between two lists of files (FileDigest or InputFile), matched by path."""
    w = {e.path: e for e in want}
    h = {e.path: e for e in have}
    out = [f"{what} {p}: missing" for p in sorted(set(w) - set(h))]
    out += [f"{what} {p}: not in the manifest" for p in sorted(set(h) - set(w))]
    out += [
        f"{what} {p}: sha256 differs" for p in sorted(set(w) & set(h)) if w[p].sha256 != h[p].sha256
    ]
    return out


def compare_outputs(manifest: contracts.Provenance, results_dir) -> dict:
    """Compare a rerun's results with the manifest.

    prepare (prompts/) and tokenize (tokenized/) outputs must be byte-identical; generated
    shards are compared sample by sample (identical output_ids per prompt_id).
    """
    results = Path(results_dir)
    # A dataset folder's manifest keeps the run's outputs as run_outputs.
    want = {e.path: e for e in manifest.run_outputs or manifest.outputs}
    exact = {"identical": [], "different": [], "missing": []}
    for path, e in sorted(want.items()):
        if not path.startswith(("prompts/", "tokenized/")):
            continue
        p = results / path
        if not p.exists():
            exact["missing"].append(path)
        elif sha256_file(p) == e.sha256:
            exact["identical"].append(path)
        else:
            exact["different"].append(path)
    samples = {"total": 0, "identical": 0, "different": 0, "missing": 0, "files": {}}
    for path, digests in sorted(manifest.generated_samples.items()):
        have = sample_digests(results / path) if (results / path).exists() else {}
        same = sum(1 for k, d in digests.items() if have.get(k) == d)
        missing = sum(1 for k in digests if k not in have)
        f = {
            "total": len(digests),
            "identical": same,
            "missing": missing,
            "different": len(digests) - same - missing,
        }
        samples["files"][path] = f
        for k in ("total", "identical", "different", "missing"):
            samples[k] += f[k]
    ok = not exact["different"] and not exact["missing"]
    return {
        "schema": "tokenmill.compare/1",
        "byte_identical_stages": exact,
        "generated_samples": samples,
        "ok": ok,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill provenance")
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--config-json", help="resolved config (file or JSON)")
    parser.add_argument("--configfiles", nargs="*", default=[])
    parser.add_argument(
        "--configfiles-json", help="the config files as a JSON list (what the workflow passes)"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--dataset-out",
        help="also write the dataset folder's own manifest here (results/dataset/provenance.json)",
    )
    parser.add_argument("--basedir", default=".")
    parser.add_argument(
        "--compare",
        metavar="MANIFEST",
        help="compare --results-dir with MANIFEST; write the report to --out",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="with --compare: exit 0 even when outputs differ (the report says how)",
    )
    args = parser.parse_args(argv)
    if args.compare:
        try:
            manifest = contracts.Provenance.read(args.compare)
        except contracts.RecordError as exc:
            print(f"tokenmill provenance: --compare: {exc}", file=sys.stderr)
            return 1
        report = compare_outputs(manifest, args.results_dir)
        contracts.write_json_atomic(args.out, report)
        s = report["generated_samples"]
        print(
            f"byte-identical: {len(report['byte_identical_stages']['identical'])} files, "
            f"different: {report['byte_identical_stages']['different']}, missing: "
            f"{report['byte_identical_stages']['missing']}; generated samples identical "
            f"{s['identical']}/{s['total']}",
            file=sys.stderr,
        )
        return 0 if report["ok"] or args.report_only else 1
    if not args.config_json:
        parser.error("--config-json is required")
    try:
        config = load_section(args.config_json, None)
    except ConfigError as exc:
        print(f"tokenmill provenance: --config-json: {exc}", file=sys.stderr)
        return 1
    configfiles = list(args.configfiles)
    if args.configfiles_json:
        configfiles += json.loads(args.configfiles_json)
    manifest = build(args.results_dir, config, configfiles, args.basedir, args.out)
    if args.dataset_out:
        dtmp = contracts.atomic_path(args.dataset_out)
        dtmp.write_text(dumps(dataset_manifest(manifest), config))
        dtmp.replace(args.dataset_out)
    tmp = contracts.atomic_path(args.out)
    tmp.write_text(dumps(manifest, config), encoding="utf-8")
    tmp.replace(args.out)
    return 0
