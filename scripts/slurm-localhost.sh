#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for the course's tests, CI and
# instructors trying lab 13's job scripts without a real cluster.
#
#   scripts/slurm-localhost.sh start     # install what is missing, then start (a no-op when it is up)
#   scripts/slurm-localhost.sh status    # say whether it is up; exit 0 when it is
#   scripts/slurm-localhost.sh stop      # stop slurmd, slurmctld and munged
#   scripts/slurm-localhost.sh install   # only install what is missing
#
# It needs root and Debian's (or Ubuntu's) `slurm-wlm` and `munge` packages, and
# `bubblewrap`, the isolation layer the node grades with (k2c grade-class
# --slurm grades nothing on a node without it). `start` installs what is
# missing with apt-get; without apt-get it says what to install.
# No systemd: it starts `munged` as the munge user, writes /etc/slurm/slurm.conf
# (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none, no accounting,
# select/cons_tres, SlurmUser=root; one node "localhost" at 127.0.0.1 with this
# machine's CPU count and one GPU as GRES; partition "k2c", the default, and
# partition "gpu", both of that node, with OverSubscribe=FORCE:4) and no
# cgroup.conf (slurmd fails to start with one), then runs `slurmctld` and
# `slurmd` and waits until `sinfo` shows the node idle. Jobs run as root.
# With 2 CPUs, a job of 4 tasks on the node needs `--overcommit` (`-O`).
#
# The GPU is a stand-in, so that GPU jobs (`--gres=gpu:1`, `--gpus=1`) can be
# tried without one: GresTypes=gpu, Gres=gpu:1 on the node, and a gres.conf with
# AutoDetect=off and File=/dev/null. slurmd 22.05 drops a GPU without File=
# ("Removing file-less GPU", and the node is then INVAL: "gres/gpu count reported
# lower than configured"); /dev/null is a character device every machine has.
# A job that asks for it gets CUDA_VISIBLE_DEVICES=0 and SLURM_JOB_GPUS=0, and
# CUDA still finds no device: k2c's GPU tier refuses to grade there, saying so.
#
# MinJobAge=4 keeps `sbatch --wait` polling every 2 s (it backs off up to 32 s
# while its interval is below MinJobAge/2); a finished job's record stays at
# least 4 s.
#
# A slurm.conf or gres.conf that this script did not write is never overwritten
# (set K2C_SLURM_FORCE=1 to replace them). Logs: /var/log/slurm/slurm{ctld,d}.log and
# /var/log/munge/munged.log. Exit status: 0 when the cluster is up (start,
# install, status) or down (stop); 1 with a message saying why otherwise.
set -uo pipefail

CONF=/etc/slurm/slurm.conf
GRES=/etc/slurm/gres.conf
MARK="# Written by k2c scripts/slurm-localhost.sh"
NODE=localhost
PARTITION=k2c
GPU_PARTITION=gpu
WAIT_S=${K2C_SLURM_WAIT_S:-60}
STATE=/var/spool/slurmctld
SPOOL=/var/spool/slurmd
LOGS=/var/log/slurm
PACKAGES=(slurm-wlm munge bubblewrap)

say() { echo "slurm-localhost: $*"; }
die() { echo "slurm-localhost: $*" >&2; exit 1; }

have_packages() {
  local c
  for c in slurmctld slurmd sbatch sinfo scontrol munged munge bwrap; do
    command -v "$c" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$c" >/dev/null 2>&1 || return 1
  done
}

need_root() {
  [ "$(id -u)" = 0 ] || die "run this as root (it writes $CONF and starts the SLURM daemons as root)"
}

install_packages() {
  need_root
  if have_packages; then return 0; fi
  command -v apt-get >/dev/null 2>&1 || die "no apt-get here: install SLURM (slurmctld, slurmd, sbatch, srun, sinfo, scontrol), munge (munged) and bubblewrap (bwrap) with this system's package manager (dnf install slurm-slurmctld slurm-slurmd munge bubblewrap), then run '$0 start' again"
  say "installing ${PACKAGES[*]} (apt-get)"
  apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${PACKAGES[@]}" >/dev/null || die "apt-get install ${PACKAGES[*]} failed"
}

pid_alive() {  # pid_alive PIDFILE NAME: the daemon of that pid file runs
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && grep -q "$2" "/proc/$pid/comm" 2>/dev/null  # (kill -0 fails for another user)
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  if munge_ok; then return 0; fi
  if [ ! -s /etc/munge/munge.key ]; then
    say "creating /etc/munge/munge.key"
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null 2>&1; then mungekey --create --keyfile=/etc/munge/munge.key >/dev/null
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /etc/munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
  chmod 0700 /etc/munge /var/log/munge /var/lib/munge
  chmod 0400 /etc/munge/munge.key
  chmod 0755 /run/munge
  rm -f /run/munge/munged.pid
  runuser -u munge -- munged --force >/dev/null 2>&1 || true
  local i
  for i in $(seq 1 50); do munge_ok && return 0; sleep 0.1; done
  die "munged did not start (see /var/log/munge/munged.log)"
}

config_text() {
  local cpus
  cpus=$(nproc)
  cat <<EOF
$MARK: a one-node cluster on
# localhost for the course's tests (see that script). Safe to delete when it is stopped.
ClusterName=k2c
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE
SlurmdSpoolDir=$SPOOL
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=4
GresTypes=gpu
NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE CPUs=$cpus Gres=gpu:1 State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
PartitionName=$GPU_PARTITION Nodes=$NODE MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
}

gres_text() {
  cat <<EOF
$MARK: the node's one GPU,
# a stand-in with no GPU behind it (see that script): slurmd 22.05 drops a GPU without File=.
AutoDetect=off
NodeName=$NODE Name=gpu File=/dev/null
EOF
}

configured() {  # slurm.conf and gres.conf are what this script writes
  [ -e "$CONF" ] && [ "$(cat "$CONF")" = "$(config_text)" ] && [ -e "$GRES" ] && [ "$(cat "$GRES")" = "$(gres_text)" ]
}

write_file() {  # write_file PATH TEXT: returns 0 when the file changed
  if [ -e "$1" ] && ! grep -qF "$MARK" "$1" && [ "${K2C_SLURM_FORCE:-}" != 1 ]; then
    die "$1 exists and was not written by this script; set K2C_SLURM_FORCE=1 to replace it"
  fi
  if [ -e "$1" ] && [ "$(cat "$1")" = "$2" ]; then return 1; fi
  mkdir -p "$(dirname "$1")"
  printf '%s\n' "$2" > "$1"
  return 0
}

write_config() {  # returns 0 when slurm.conf or gres.conf changed
  if [ -e /etc/slurm/cgroup.conf ]; then
    die "/etc/slurm/cgroup.conf exists: slurmd does not start with it in a container; move it away and retry"
  fi
  local changed=1
  write_file "$CONF" "$(config_text)" && changed=0
  write_file "$GRES" "$(gres_text)" && changed=0
  return $changed
}

node_state() { sinfo -h -n "$NODE" -p "$PARTITION" -o %t 2>/dev/null | head -1 | tr -d '*~#'; }

is_up() {
  pid_alive /run/slurmctld.pid slurmctld && pid_alive /run/slurmd.pid slurmd \
    && scontrol ping 2>/dev/null | grep -q UP \
    && case "$(node_state)" in idle|mix|alloc|comp) true ;; *) false ;; esac
}

stop_daemons() {
  local name pidfile pid i
  for name in slurmd slurmctld; do
    pidfile=/run/$name.pid
    if pid_alive "$pidfile" "$name"; then
      pid=$(cat "$pidfile")
      kill "$pid" 2>/dev/null
      for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
    fi
    rm -f "$pidfile"
  done
}

start() {
  PATH="$PATH:/usr/sbin:/sbin"
  if have_packages && configured && is_up; then
    say "already up: node $NODE ($(nproc) CPUs, a stand-in GPU) in partitions $PARTITION and $GPU_PARTITION is $(node_state)"; return 0
  fi
  [ "$(id -u)" = 0 ] || die "run this as root: sudo $0 start (it installs ${PACKAGES[*]} when missing, writes $CONF and starts the SLURM daemons)"
  have_packages || install_packages
  local changed=0
  write_config && changed=1
  start_munge
  mkdir -p "$STATE" "$SPOOL" "$LOGS"
  if [ $changed = 1 ]; then stop_daemons; fi
  if ! pid_alive /run/slurmctld.pid slurmctld; then
    slurmctld || die "slurmctld did not start (see $LOGS/slurmctld.log)"
  fi
  if ! pid_alive /run/slurmd.pid slurmd; then
    slurmd -N "$NODE" || die "slurmd did not start (see $LOGS/slurmd.log)"
  fi
  local i state=""
  for i in $(seq 1 $((WAIT_S * 2))); do
    state=$(node_state)
    case "$state" in
      idle|mix|alloc|comp) say "up: node $NODE ($(nproc) CPUs, a stand-in GPU) in partitions $PARTITION and $GPU_PARTITION is $state"; return 0 ;;
      down|drain|drng|fail) scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 ;;
    esac
    if [ "$i" -gt 4 ]; then  # both daemons have had 2 s to write their pid files
      pid_alive /run/slurmctld.pid slurmctld || fail_start "slurmctld exited"
      pid_alive /run/slurmd.pid slurmd || fail_start "slurmd exited"
    fi
    sleep 0.5
  done
  fail_start "the node did not become idle within ${WAIT_S} s (state: ${state:-unknown})"
}

fail_start() {
  echo "slurm-localhost: could not start the cluster: $1." >&2
  echo "  last lines of $LOGS/slurmctld.log and $LOGS/slurmd.log:" >&2
  tail -n 5 "$LOGS/slurmctld.log" "$LOGS/slurmd.log" >&2 2>/dev/null
  exit 1
}

stop() {
  need_root
  PATH="$PATH:/usr/sbin:/sbin"
  stop_daemons
  if pid_alive /run/munge/munged.pid munged; then
    munged --stop >/dev/null 2>&1 || kill "$(cat /run/munge/munged.pid)" 2>/dev/null
  fi
  say "stopped"
}

status() {
  PATH="$PATH:/usr/sbin:/sbin"
  if ! have_packages; then say "SLURM is not installed"; exit 1; fi
  if is_up; then
    say "up: node $NODE in partition $PARTITION is $(node_state)"
    sinfo 2>/dev/null
    return 0
  fi
  say "down (slurmctld $(pid_alive /run/slurmctld.pid slurmctld && echo runs || echo 'does not run'), slurmd $(pid_alive /run/slurmd.pid slurmd && echo runs || echo 'does not run'))"
  exit 1
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  install) install_packages; say "installed: ${PACKAGES[*]}" ;;
  *) echo "usage: $0 {start|stop|status|install}" >&2; exit 2 ;;
esac
