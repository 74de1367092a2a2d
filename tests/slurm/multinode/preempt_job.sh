#!/bin/bash
# A preemptible job, shaped like a snakemake-executor-plugin-slurm job: the batch script (this
# file, no argument) runs the "rule" as a job step (`srun -n1 <this file> step`), as the jobstep
# plugin does. Both log their start (with SLURM_RESTART_COUNT) and each SIGTERM/SIGCONT/SIGUSR1
# they get, with timestamps, to $PREEMPT_LOG (one JSON line per event).
who="${1:-batch}"
log() { echo "{\"who\":\"$who\",\"job\":\"$SLURM_JOB_ID\",\"event\":\"$1\",\"t\":${EPOCHREALTIME},\"restart\":\"${SLURM_RESTART_COUNT:-0}\"}" >>"$PREEMPT_LOG"; }
trap 'log TERM' TERM
trap 'log CONT' CONT
trap 'log USR1' USR1
log start
if [ "$who" = batch ]; then
  srun -n1 --nodes=1 "$0" step &
  while kill -0 $! 2>/dev/null; do sleep 0.1 || true; done
else
  for ((i = 0; i < 3000; i++)); do sleep 0.1 || true; done
fi
log end
