#!/bin/bash
# What snakemake-executor-plugin-slurm-jobstep 0.6.1 does inside a job (its run_job): drop every
# SLURM_* variable except its keep list, every SRUN_* and SBATCH_*, then run the rule with
#   srun -n1 --cpu-bind=q --cpus-per-task=1 [--gpus=G] --nodes=N <rule command>
# (get_cpu_setting / get_gpu_setting / get_node_setting). Usage: jobstep.sh G N CMD...
G=$1 N=$2
shift 2
keep=" SLURM_JOB_ID SLURM_JOBID SLURM_ARRAY_JOB_ID SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_MIN SLURM_ARRAY_TASK_MAX SLURM_ARRAY_TASK_STEP SLURM_CLUSTER_NAME SLURM_SUBMIT_DIR SLURM_SUBMIT_HOST SLURM_CONF "
for v in $(compgen -e); do
  case $v in
  SLURM_*) [[ "$keep" == *" $v "* ]] || unset "$v" ;;
  SRUN_* | SBATCH_*) unset "$v" ;;
  esac
done
gpus=()
[ "$G" -gt 0 ] && gpus=(--gpus="$G")
exec srun -n1 --cpu-bind=q --cpus-per-task=1 "${gpus[@]}" --nodes="$N" "$@"
