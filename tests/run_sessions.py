"""The whole suite for `make test`: three pytest sessions at once, each logging to its own file.

The two SLURM sessions spend most of their time waiting (job starts, time limits, the plugin's
status polls), so they run beside the session that uses the CPUs:
- slurm-1node: the tests marked `slurm` of tests/test_slurm.py and tests/test_readme_commands.py
  on the single-node cluster (config in /etc/slurm);
- slurm-2node: tests/test_slurm_multinode.py on the two-node cluster (its own config folder,
  so both clusters run at once);
- main: everything else (`-m "not slurm"`).
Each session's log is printed whole when it ends, then one line per session: its result, wall
time and CPU time (its processes and every descendant they waited for). The exit status is
non-zero when any session failed (or collected nothing).

Usage: python tests/run_sessions.py [--logs DIR] [--tmp DIR] [--only NAME ...] [-- pytest args]
(--tmp: each session's pytest --basetemp is DIR/NAME, emptied when the session starts.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLURM_1 = "tests/test_slurm.py"
SLURM_2 = "tests/test_slurm_multinode.py"
README_COMMANDS = "tests/test_readme_commands.py"  # its SLURM test runs on the single-node cluster

# name: (pytest arguments, environment). The main session runs on three pytest-xdist workers,
# whole modules each (module fixtures and the order inside a module stay as they are): three on
# two CPUs, because its tests also wait (engine starts, kills, locks, the shared demo run) and a
# third worker uses those waits (measured at d7aa0cc: 19.6 min and 1.3 idle CPU-minutes, against
# 21.5 and 5.3 with two).
SESSIONS: dict[str, tuple[list[str], dict[str, str]]] = {
    "slurm-1node": (["-m", "slurm", SLURM_1, README_COMMANDS], {}),
    "slurm-2node": ([SLURM_2], {"TOKENMILL_SLURM_NODES": "2"}),
    "main": (
        ["-m", "not slurm", f"--ignore={SLURM_1}", f"--ignore={SLURM_2}"]
        + ["-n", "3", "--dist", "loadfile", "--no-loadscope-reorder"],  # conftest's order
        {},
    ),
}


def machine_cpu_s() -> tuple[float, float] | None:
    """(busy, idle) CPU seconds of the whole machine so far, from /proc/stat (None elsewhere):
    what every process used, the SLURM clusters' jobs and daemons included, which no session's
    own CPU time counts."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / hz, (idle + iowait) / hz


def main(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs", type=Path, default=ROOT / ".test-logs")
    parser.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()) / "tokenmill-tests")
    parser.add_argument("--only", nargs="+", choices=sorted(SESSIONS), default=list(SESSIONS))
    args = parser.parse_args(argv)
    args.logs.mkdir(parents=True, exist_ok=True)
    args.tmp.mkdir(parents=True, exist_ok=True)  # pytest makes --basetemp but not its parents

    started, cpu_at_start = time.monotonic(), machine_cpu_s()
    running = {}
    for name in args.only:
        paths, env = SESSIONS[name]
        log = args.logs / f"{name}.log"
        # Its own --basetemp: a failed test's files stay there for a look after the run (pytest
        # keeps only its last three numbered folders, and the sessions make three at once).
        basetemp = args.tmp / name
        cmd = [sys.executable, "-m", "pytest", "-q", "--durations=25", f"--basetemp={basetemp}"]
        cmd += [*paths, *extra]
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT
            )
        running[name] = (proc, log, time.monotonic())
        print(f"run_sessions: {name}: {' '.join(cmd[2:])} (log {log})", flush=True)

    results = {}
    by_pid = {proc.pid: name for name, (proc, _, _) in running.items()}
    while running:
        pid, status, usage = os.wait4(-1, 0)
        if pid not in by_pid:
            continue
        name = by_pid[pid]
        proc, log, t0 = running.pop(name)
        proc.returncode = os.waitstatus_to_exitcode(status)
        cpu = usage.ru_utime + usage.ru_stime
        results[name] = (proc.returncode, time.monotonic() - t0, cpu)
        print(f"\n===== {name}: exit {proc.returncode} =====", flush=True)
        sys.stdout.write(log.read_text(errors="replace"))
        sys.stdout.flush()

    print("\nrun_sessions:")
    for name, (rc, wall, cpu) in results.items():
        status = "passed" if rc == 0 else f"FAILED (exit {rc})"
        print(f"  {name:<12} {status:<16} {wall / 60:5.1f} min wall {cpu / 60:6.1f} min CPU")
    cpu_at_end = machine_cpu_s()
    if cpu_at_start and cpu_at_end:
        busy, idle = (end - start for start, end in zip(cpu_at_start, cpu_at_end, strict=True))
        print(
            f"  machine: {(time.monotonic() - started) / 60:.1f} min wall, {busy / 60:.1f} min CPU "
            f"busy and {idle / 60:.1f} min idle on {os.cpu_count()} CPUs (every process: the "
            "SLURM jobs too)"
        )
    return 0 if all(rc == 0 for rc, _, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
