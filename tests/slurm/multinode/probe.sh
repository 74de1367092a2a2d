#!/bin/bash
# One JSON line per task: where it ran and what SLURM gave it. $1 = a label.
printf '{"label":"%s","node":"%s","procid":"%s","nodeid":"%s","cuda":"%s","step_gpus":"%s","step":"%s","job_nodelist":"%s","nodelist":"%s"}\n' \
  "$1" "$SLURMD_NODENAME" "$SLURM_PROCID" "$SLURM_NODEID" "${CUDA_VISIBLE_DEVICES-unset}" \
  "${SLURM_STEP_GPUS-unset}" "$SLURM_STEP_ID" "$SLURM_JOB_NODELIST" "$SLURM_NODELIST"
