#!/bin/bash
# The rule's command inside the jobstep's step: the engine launch of tokenmill.engine
# (srun --overlap --nodes=2 --ntasks=2 --ntasks-per-node=1) with the inherited environment,
# without SLURM_JOB_NODELIST only, and with the jobstep plugin's strip list. $1 = probe.
P=$1
here="$(cd "$(dirname "$0")" && pwd)"
"$P" rule
launch=(srun --overlap --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1)
run() { # run <label> <env args...>
  local label=$1 out rc
  shift
  out="$(env "$@" timeout 30 "${launch[@]}" "$P" "$label" 2>&1)" && rc=0 || rc=$?
  printf '%s\n' "$out" | grep '^{' || true
  printf '{"label":"%s","rc":%d,"stderr":"%s"}\n' "$label" "$rc" "$(printf '%s' "$out" | grep -v '^{' | tr '\n"' ' _')"
}
run inherited
run no_job_nodelist -u SLURM_JOB_NODELIST
# shellcheck disable=SC2046
run stripped $(for v in $(compgen -e); do case $v in
  SLURM_JOB_ID | SLURM_JOBID | SLURM_CLUSTER_NAME | SLURM_SUBMIT_DIR | SLURM_SUBMIT_HOST | SLURM_CONF) ;;
  SLURM_* | SRUN_* | SBATCH_*) echo "-u $v" ;; esac; done)
