"""What every GPU job of the pipeline shares (generate, hidden_states): the job harness
(harness.py: the shard lock, signals, attempts and their GPU-hours, deterministic failures),
the shard lock itself (lock.py), the SLURM resources of a job at each attempt (resources.py),
and the controller's preemption watchdog (preemption.py). Shared modules: they import no stage.
"""
