#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for tokenmill's SLURM tests (tests/test_slurm.py)
# and for trying the slurm profile by hand. Debian 12 (slurm-wlm 22.05), run as root, no systemd
# needed: every daemon is started by hand and stopped by the PID it was started with.
#
#   tests/slurm/cluster.sh install   apt-get install slurm-wlm munge slurmdbd mariadb-server
#   tests/slurm/cluster.sh start     write the config, start munged, MariaDB, slurmdbd, slurmctld,
#                                    slurmd; wait until the node is idle and sacct answers
#   tests/slurm/cluster.sh stop      cancel the jobs, stop the daemons this script started
#   tests/slurm/cluster.sh status    which daemons are up (exit 0 when the cluster answers)
#   tests/slurm/cluster.sh up        install (if needed) + start
#
# Every command is idempotent: `start` on a running cluster does nothing, `stop` on a stopped one
# does nothing, and a daemon that was already running before `start` (munged, say) is reused and
# never stopped. The script refuses to replace a /etc/slurm/slurm.conf it did not write.
#
# Settings (environment):
#   TOKENMILL_SLURM_RUN   state, spool, logs, PID files, database (default /tmp/tokenmill-slurm,
#                         two-node mode /tmp/tokenmill-slurm2)
#   TOKENMILL_SLURM_GPUS  fake GPUs per node, GRES gpu type "fake" (default 2; 0 = none)
#   TOKENMILL_SLURM_DB_PORT  MariaDB port on 127.0.0.1 (default 3306, two-node mode 3307)
#   TOKENMILL_SLURM_NODES 1 (default) or 2, the two-node mode below
#   TOKENMILL_SLURM_ETC   two-node mode only: its config folder (default $RUN/etc; /etc/slurm for
#                         real snakemake runs, whose jobstep plugin drops SLURM_CONF)
# The cluster: ClusterName=ci, one node (this host, 127.0.0.1), partition "debug" (default),
# accounting through slurmdbd (so `sacct`, which the snakemake plugin polls with, answers;
# user root's account is "root").
#
# Two-node mode (TOKENMILL_SLURM_NODES=2): a second, separate cluster "ci2" that can run next to
# the single-node one. Two slurmd daemons on this host (`slurmd -N n1`, `slurmd -N n2`, each
# NodeName with its own Port=, both NodeAddr=127.0.0.1), each with TOKENMILL_SLURM_GPUS fake
# GPUs. Its config lives in $RUN/etc (not /etc/slurm): every SLURM command against it needs
#   export SLURM_CONF=/tmp/tokenmill-slurm2/etc/slurm.conf
# (`cluster.sh env` prints that line). Its own MariaDB (port 3307) and slurmdbd (port 16820),
# slurmctld on 16817, slurmd on 16818/16819. Partitions, for the preemption measurements
# (PreemptType=preempt/partition_prio): debug (default, PriorityTier=1, PreemptMode=REQUEUE),
# lowcancel (PriorityTier=1, PreemptMode=CANCEL), lowgrace (PriorityTier=1, PreemptMode=REQUEUE,
# GraceTime=10) and high (PriorityTier=10, preempts the other three).
set -euo pipefail

NODES="${TOKENMILL_SLURM_NODES:-1}"
NGPU="${TOKENMILL_SLURM_GPUS:-2}"
PART=debug
case "$NODES" in
1)
  RUN="${TOKENMILL_SLURM_RUN:-/tmp/tokenmill-slurm}"
  DBPORT="${TOKENMILL_SLURM_DB_PORT:-3306}"
  ETC=/etc/slurm # Debian's slurm reads /etc/slurm/slurm.conf
  ;;
2)
  RUN="${TOKENMILL_SLURM_RUN:-/tmp/tokenmill-slurm2}"
  DBPORT="${TOKENMILL_SLURM_DB_PORT:-3307}"
  # A private config: SLURM_CONF points at it (slurmdbd.conf and gres.conf too).
  # TOKENMILL_SLURM_ETC=/etc/slurm puts it where SLURM looks without SLURM_CONF, which a real
  # snakemake run needs: the jobstep plugin drops SLURM_CONF before its srun (never while the
  # single-node cluster runs: it refuses).
  ETC="${TOKENMILL_SLURM_ETC:-$RUN/etc}"
  export SLURM_CONF="$ETC/slurm.conf"
  ;;
*)
  echo "TOKENMILL_SLURM_NODES must be 1 or 2, not '$NODES'" >&2
  exit 2
  ;;
esac
MARK="# written by tokenmill tests/slurm/cluster.sh"
DBPASS=tokenmill-ci # MariaDB on 127.0.0.1 only, for slurmdbd

log() { printf '[cluster.sh %s] %s\n' "$(date +%T)" "$*" >&2; }
die() {
  log "ERROR: $*"
  exit 1
}

wait_for() { # wait_for <seconds> <cmd...>: poll every 0.2 s; each try bounded by `timeout`
  local n=$(($1 * 5))
  shift
  for ((i = 0; i < n; i++)); do
    timeout 10 "$@" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  return 1
}

alive() { # a zombie (exited, not yet reaped by a slow PID 1) counts as dead
  local st
  st="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
  [ -n "$st" ] && [ "${st#Z}" = "$st" ]
}

pid_alive() { [ -s "$RUN/$1.pid" ] && alive "$(cat "$RUN/$1.pid")"; }

need_root() { [ "$(id -u)" = 0 ] || die "must run as root (it starts system daemons)"; }

installed() { command -v slurmctld && command -v munged && command -v slurmdbd && command -v mariadbd; } >/dev/null 2>&1

do_install() {
  need_root
  if installed; then
    log "packages already installed"
    return 0
  fi
  command -v apt-get >/dev/null || die "apt-get not found (Debian/Ubuntu only)"
  export DEBIAN_FRONTEND=noninteractive
  local pkgs=(slurm-wlm munge slurmdbd mariadb-server) aptlog="$RUN/log/apt.log"
  mkdir -p "$RUN/log"
  # Package lists are missing on a fresh machine: update once, then install.
  if ! apt-cache show slurm-wlm >/dev/null 2>&1; then
    log "apt-get update"
    apt-get update -qq >"$aptlog" 2>&1 || {
      tail -n 20 "$aptlog" >&2
      die "apt-get update failed"
    }
  fi
  log "apt-get install ${pkgs[*]}"
  # Without systemd (and with policy-rc.d) the postinst scripts start nothing; we do that.
  apt-get install -y --no-install-recommends "${pkgs[@]}" >>"$aptlog" 2>&1 || {
    tail -n 30 "$aptlog" >&2
    die "apt-get install failed (log: $aptlog)"
  }
  log "installed"
}

write_config() {
  mkdir -p "$RUN"/{state,spool,log} "$ETC"
  if [ -f "$ETC/slurm.conf" ] && ! grep -qF "$MARK" "$ETC/slurm.conf"; then
    die "$ETC/slurm.conf exists and was not written by this script; not touching it"
  fi
  local host hw cpus mem topo
  host="$(hostname -s)"
  # e.g. "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24152"
  hw="$(slurmd -C | head -n 1)"
  cpus="$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw")"
  mem="$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")"
  topo="$(grep -o 'Boards=.*ThreadsPerCore=[0-9]*' <<<"$hw" || true)"
  mem=$((mem * 9 / 10)) # headroom, else the node drains with "Low RealMemory"

  local gres_types="" gres_node=""
  if [ "$NGPU" -gt 0 ]; then
    # slurm 22.05 drops file-less GPUs and rejects regular files as devices: symlinks to
    # /dev/null pass its check and need no mknod.
    mkdir -p "$RUN/fakegpu"
    for ((g = 0; g < NGPU; g++)); do ln -sfn /dev/null "$RUN/fakegpu/nvidia$g"; done
    gres_types="GresTypes=gpu"
    gres_node="Gres=gpu:fake:$NGPU"
    printf '%s\nNodeName=%s Name=gpu Type=fake File=%s/fakegpu/nvidia[0-%d]\n' \
      "$MARK" "$host" "$RUN" $((NGPU - 1)) >"$ETC/gres.conf"
  else
    rm -f "$ETC/gres.conf"
  fi

  cat >"$ETC/slurm.conf" <<EOF
$MARK (run dir $RUN)
ClusterName=ci
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$RUN/state
SlurmdSpoolDir=$RUN/spool
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$RUN/log/slurmctld.log
SlurmdLogFile=$RUN/log/slurmd.log
# No cgroups in this VM: plain process tracking (it still follows the engine's own session).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
# sacct (the plugin's status command) needs accounting through slurmdbd.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
DefMemPerCPU=500
ReturnToService=2
# SIGTERM at the time limit, SIGKILL this many seconds later.
KillWait=5
MinJobAge=300
$gres_types
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus $topo RealMemory=$mem $gres_node State=UNKNOWN
PartitionName=$PART Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

  cat >"$ETC/slurmdbd.conf" <<EOF
$MARK
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
LogFile=$RUN/log/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DBPORT
StorageUser=slurm
StoragePass=$DBPASS
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$ETC/slurmdbd.conf" # slurmdbd refuses a readable config
  log "config: $ETC/slurm.conf (CPUs=$cpus RealMemory=$mem fake GPUs=$NGPU, run dir $RUN)"
}

# Two nodes n1 and n2 on this host (NOTES.md "Two nodes on one host"), own ports and run dir.
write_config2() {
  mkdir -p "$RUN"/{state,spool/n1,spool/n2,log} "$ETC"
  if [ -f "$ETC/slurm.conf" ] && ! grep -qF "$MARK" "$ETC/slurm.conf"; then
    die "$ETC/slurm.conf exists and was not written by this script; not touching it"
  fi
  local host hw cpus mem topo
  host="$(hostname -s)"
  hw="$(slurmd -C | head -n 1)"
  cpus="$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw")"
  mem="$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")"
  topo="$(grep -o 'Boards=.*ThreadsPerCore=[0-9]*' <<<"$hw" || true)"
  mem=$((mem * 4 / 10)) # two nodes share this host's memory

  local gres_types="" gres_node=""
  if [ "$NGPU" -gt 0 ]; then
    mkdir -p "$RUN/fakegpu"
    for ((g = 0; g < NGPU; g++)); do ln -sfn /dev/null "$RUN/fakegpu/nvidia$g"; done
    gres_types="GresTypes=gpu"
    gres_node="Gres=gpu:fake:$NGPU"
    # One line per node: each slurmd (-N n1 / -N n2) reads the line of its own name.
    printf '%s\nNodeName=n1 Name=gpu Type=fake File=%s/fakegpu/nvidia[0-%d]\nNodeName=n2 Name=gpu Type=fake File=%s/fakegpu/nvidia[0-%d]\n' \
      "$MARK" "$RUN" $((NGPU - 1)) "$RUN" $((NGPU - 1)) >"$ETC/gres.conf"
  else
    rm -f "$ETC/gres.conf"
  fi

  cat >"$ETC/slurm.conf" <<EOF
$MARK (run dir $RUN, two-node mode)
ClusterName=ci2
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$RUN/state
SlurmdSpoolDir=$RUN/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.%n.pid
SlurmctldLogFile=$RUN/log/slurmctld.log
SlurmdLogFile=$RUN/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=16820
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
DefMemPerCPU=500
ReturnToService=2
KillWait=5
MinJobAge=300
# Preemption by partition priority: jobs in "high" preempt jobs of the PriorityTier=1 partitions.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
$gres_types
NodeName=n1 NodeAddr=127.0.0.1 Port=16818 CPUs=$cpus $topo RealMemory=$mem $gres_node State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port=16819 CPUs=$cpus $topo RealMemory=$mem $gres_node State=UNKNOWN
PartitionName=$PART Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE
PartitionName=lowcancel Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=CANCEL
PartitionName=lowgrace Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=10
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF

  cat >"$ETC/slurmdbd.conf" <<EOF
$MARK
AuthType=auth/munge
DbdHost=localhost
DbdPort=16820
SlurmUser=root
LogFile=$RUN/log/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DBPORT
StorageUser=slurm
StoragePass=$DBPASS
StorageLoc=slurm_acct_db2
EOF
  chmod 600 "$ETC/slurmdbd.conf"
  log "config: $ETC/slurm.conf (nodes n1 n2, CPUs=$cpus RealMemory=$mem fake GPUs=$NGPU each, run dir $RUN)"
}

start_munge() {
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile /etc/munge/munge.key 2>/dev/null ||
      dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
  fi
  mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
  # One munged serves both clusters: when both start at once, one starts it, the other reuses.
  exec 8>/run/munge/tokenmill-start.lock
  flock -w 120 8 || die "another cluster.sh held the munged start lock for 2 min"
  if timeout 5 sh -c 'munge -n </dev/null | unmunge' >/dev/null 2>&1; then
    log "munged already running: reusing it (and leaving it running at stop)"
    exec 8>&-
    return 0
  fi
  # 8>&-: the daemon must not inherit the lock (it would hold it for as long as it runs).
  runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid 8>&-
  wait_for 10 sh -c 'munge -n </dev/null | unmunge' || die "munged did not come up"
  cp /run/munge/munged.pid "$RUN/munged.pid" # only what we started is stopped
  exec 8>&-
}

start_mariadb() {
  local M="$RUN/mysqlrun"
  pid_alive mariadbd && return 0
  mkdir -p "$RUN/mysql" "$M"
  chown mysql:mysql "$RUN/mysql" "$M"
  if [ ! -d "$RUN/mysql/mysql" ]; then
    mariadb-install-db --no-defaults --datadir="$RUN/mysql" --user=mysql \
      --auth-root-authentication-method=socket --skip-test-db >"$RUN/log/mariadb-install.log" 2>&1 ||
      die "mariadb-install-db failed (log: $RUN/log/mariadb-install.log)"
  fi
  # --no-defaults: ignore /etc/mysql. Socket, PID and error log in a mysql-owned folder.
  mariadbd --no-defaults --user=mysql --datadir="$RUN/mysql" \
    --socket="$M/mysqld.sock" --pid-file="$M/mysqld.pid" --log-error="$M/mariadb.err" \
    --bind-address=127.0.0.1 --port="$DBPORT" --skip-name-resolve \
    --innodb-buffer-pool-size=256M --innodb-lock-wait-timeout=900 \
    </dev/null >"$RUN/log/mariadbd.out" 2>&1 &
  echo $! >"$RUN/mariadbd.pid"
  wait_for 60 mariadb-admin --socket="$M/mysqld.sock" ping || {
    tail -n 20 "$M/mariadb.err" >&2
    die "MariaDB did not come up (port $DBPORT in use? set TOKENMILL_SLURM_DB_PORT)"
  }
  mariadb --socket="$M/mysqld.sock" -u root -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DBPASS';
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DBPASS';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
    GRANT ALL ON slurm_acct_db2.* TO 'slurm'@'127.0.0.1';
    GRANT ALL ON slurm_acct_db2.* TO 'slurm'@'localhost';
    FLUSH PRIVILEGES;"
}

cluster_up() { timeout 5 scontrol ping 2>/dev/null | grep -q UP && timeout 5 sinfo -h -N -o %T 2>/dev/null | grep -qxE 'idle|mixed|allocated'; }

# Two-node mode: both slurmd up and both nodes usable.
SLURMDS=(slurmd.n1 slurmd.n2)
# (completing counts: a job just cancelled must not make `status` report the cluster down)
nodes_idle() { [ "$(timeout 5 sinfo -h -N -p "$PART" -o '%N %T' 2>/dev/null | grep -cE ' (idle|mixed|allocated|completing)$')" = 2 ]; }
cluster2_up() { timeout 5 scontrol ping 2>/dev/null | grep -q UP && nodes_idle; }

do_start2() {
  need_root
  installed || die "SLURM is not installed: run '$0 install' first"
  if pid_alive slurmctld && pid_alive slurmd.n1 && pid_alive slurmd.n2 && cluster2_up; then
    log "already running: $(sinfo -h -o '%P %a %D %T %G' | tr '\n' ';')"
    return 0
  fi
  if [ "$ETC" = /etc/slurm ] && ! pid_alive slurmctld; then
    local p
    for p in $(pgrep -x slurmctld || true); do
      alive "$p" && die "a slurmctld not started by this two-node cluster is running (pid $p); it may use /etc/slurm"
    done
  fi
  write_config2
  start_munge
  start_mariadb
  log "MariaDB up (port $DBPORT)"
  if ! pid_alive slurmdbd; then slurmdbd; fi
  wait_for 60 sacctmgr -n show cluster || {
    tail -n 20 "$RUN/log/slurmdbd.log" >&2
    die "slurmdbd did not come up"
  }
  log "slurmdbd up"
  if ! pid_alive slurmctld; then slurmctld; fi
  wait_for 30 sh -c 'scontrol ping | grep -q UP' || {
    tail -n 20 "$RUN/log/slurmctld.log" >&2
    die "slurmctld did not come up"
  }
  local n i
  for n in n1 n2; do
    if ! pid_alive "slurmd.$n"; then slurmd -N "$n"; fi
  done
  for ((i = 0; i < 150; i++)); do nodes_idle && break; sleep 0.2; done
  if ! nodes_idle; then
    scontrol update nodename=n1,n2 state=resume || true
    for ((i = 0; i < 150; i++)); do nodes_idle && break; sleep 0.2; done
    nodes_idle || {
      sinfo -N -o '%N %T %E' >&2
      tail -n 20 "$RUN/log/slurmd.n1.log" >&2
      die "the nodes did not become idle"
    }
  fi
  wait_for 30 sh -c 'sacctmgr -n -P show assoc format=user | grep -qx root' ||
    die "root's association did not appear in slurmdbd"
  log "up: $(sinfo -h -o '%P %a %D %T %G' | tr '\n' ';') (export SLURM_CONF=$SLURM_CONF)"
}

do_start() {
  need_root
  installed || die "SLURM is not installed: run '$0 install' first"
  if pid_alive slurmctld && pid_alive slurmd && cluster_up; then
    log "already running: $(sinfo -h -o '%P %a %D %T %G')"
    return 0
  fi
  # A slurmctld we did not start (another cluster on this machine): leave it alone.
  if ! pid_alive slurmctld; then
    local p
    for p in $(pgrep -x slurmctld || true); do
      alive "$p" && die "a slurmctld not started by this script is running (pid $p); stop it first"
    done
  fi
  write_config
  start_munge
  start_mariadb
  log "MariaDB up"
  if ! pid_alive slurmdbd; then slurmdbd; fi
  wait_for 60 sacctmgr -n show cluster || {
    tail -n 20 "$RUN/log/slurmdbd.log" >&2
    die "slurmdbd did not come up"
  }
  log "slurmdbd up"
  if ! pid_alive slurmctld; then slurmctld; fi
  wait_for 30 sh -c 'scontrol ping | grep -q UP' || {
    tail -n 20 "$RUN/log/slurmctld.log" >&2
    die "slurmctld did not come up"
  }
  if ! pid_alive slurmd; then slurmd; fi
  # The node registers and becomes idle (ReturnToService=2 also clears an old DRAIN).
  if ! wait_for 30 sh -c 'sinfo -h -N -o %T | grep -qx idle'; then
    scontrol update nodename="$(hostname -s)" state=resume || true
    wait_for 30 sh -c 'sinfo -h -N -o %T | grep -qx idle' || {
      sinfo -N -o '%N %T %E' >&2
      tail -n 20 "$RUN/log/slurmd.log" >&2
      die "the node did not become idle"
    }
  fi
  # slurmctld registers cluster "ci"; root's association (account root) exists by default.
  wait_for 30 sh -c 'sacctmgr -n -P show assoc format=user | grep -qx root' ||
    die "root's association did not appear in slurmdbd"
  log "up: $(sinfo -h -o '%P %a %D %T %G')"
}

stop_pidfile() { # stop_pidfile <name>
  local f="$RUN/$1.pid" pid
  [ -s "$f" ] || return 0
  pid="$(cat "$f")"
  if alive "$pid"; then
    kill "$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do
      alive "$pid" || break
      sleep 0.1
    done
    if alive "$pid"; then
      log "$1 ($pid) still alive after 15 s: SIGKILL"
      kill -9 "$pid" 2>/dev/null || true
    fi
    log "$1 stopped"
  fi
  rm -f "$f"
}

do_stop() {
  # Jobs first, so that no job step (and no engine it started) outlives the cluster.
  if pid_alive slurmctld && command -v scancel >/dev/null; then
    timeout 10 scancel --user="$(id -un)" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
      [ -z "$(timeout 5 squeue -h -t RUNNING,COMPLETING,PENDING -o %i 2>/dev/null)" ] && break
      sleep 0.2
    done
  fi
  local d
  for d in slurmd slurmd.n1 slurmd.n2 slurmctld slurmdbd mariadbd; do stop_pidfile "$d"; done
  # munged is shared: the other cluster (single-node or two-node) may still be using it. (A
  # slurmctld of ours can linger for a moment after its PID's exit: its script helper.)
  local other=1
  for ((i = 0; i < 50; i++)); do
    pgrep -x slurmctld >/dev/null || { other=0; break; }
    sleep 0.1
  done
  if [ "$other" = 1 ]; then
    [ -s "$RUN/munged.pid" ] && log "munged left running: another cluster still uses it"
    rm -f "$RUN/munged.pid"
  else
    stop_pidfile munged
  fi
  log "stopped"
}

do_status() {
  local d s rc=0 daemons=(munged mariadbd slurmdbd slurmctld slurmd) up=cluster_up
  if [ "$NODES" = 2 ]; then
    daemons=(munged mariadbd slurmdbd slurmctld "${SLURMDS[@]}")
    up=cluster2_up
  fi
  for d in "${daemons[@]}"; do
    if pid_alive "$d"; then s=up; else s=down; fi
    echo "$d: $s"
  done
  if $up; then
    sinfo 2>/dev/null || true
  else
    echo "cluster: not answering"
    rc=3
  fi
  return $rc
}

START=do_start
[ "$NODES" = 2 ] && START=do_start2
case "${1:-}" in
install) do_install ;;
start) $START ;;
up)
  do_install
  $START
  ;;
stop) do_stop ;;
status) do_status ;;
env) if [ "$NODES" = 2 ]; then echo "export SLURM_CONF=$SLURM_CONF"; else echo "unset SLURM_CONF"; fi ;;
*)
  echo "usage: [TOKENMILL_SLURM_NODES=2] $0 install|start|up|stop|status|env" >&2
  exit 2
  ;;
esac
