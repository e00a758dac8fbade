#!/usr/bin/env bash
# local_cluster.sh -- a real Slurm cluster of N nodes on ONE Debian/Ubuntu machine, to try
# `mplug submit` on a laptop and to run the project's Slurm tests.
#
# Debian's Slurm (22.05 on Debian 12) + munge; one slurmd per node name (`slurmd -N nodeK`), each
# on its own port; process tracking by /proc (proctrack/linuxproc), no cgroups, no systemd.
# Every file it writes (config, munge key and socket, spool, logs, pid files) lives under
# $MPLUG_SLURM_DIR, except one marked line in /etc/hosts so that node names resolve
# (MASTER_ADDR=nodeK in job scripts); `stop` removes that line again.
#
# Usage (as root):
#   slurm/local_cluster.sh up         install packages if missing, configure, start; prints 'ready'
#   slurm/local_cluster.sh stop       cancel jobs, stop only the daemons this script started
#   slurm/local_cluster.sh status     daemons (from our pid files) and sinfo
#   slurm/local_cluster.sh selftest   a 2-node sbatch + srun job; prints 'selftest passed'
#   slurm/local_cluster.sh env        prints `export SLURM_CONF=...` for: eval "$(... env)"
#   slurm/local_cluster.sh install    apt packages only
#
# Settings (environment):
#   MPLUG_SLURM_DIR=/tmp/mplug-slurm   where everything lives
#   MPLUG_SLURM_NODES=2                nodes node1..nodeN (one slurmd each)
#   MPLUG_SLURM_NODE_PREFIX=node       node name prefix
#   MPLUG_SLURM_CPUS_PER_NODE=8        CPUs advertised per node (may exceed the real cores: no binding)
#   MPLUG_SLURM_MEM_MB=4000            RealMemory advertised per node
#   MPLUG_SLURM_PORT=16817             slurmctld port; node K's slurmd listens on PORT+K
#   MPLUG_SLURM_FIRST_JOB_ID=1         first job id (job scripts derive MASTER_PORT from it)
#   MPLUG_SLURM_READY_TIMEOUT=60       seconds to wait for every node to be idle
#
# Clients (sbatch, srun, squeue, scontrol) find this cluster through SLURM_CONF; jobs inherit it.
set -Eeuo pipefail

DIR=${MPLUG_SLURM_DIR:-/tmp/mplug-slurm}
NODES=${MPLUG_SLURM_NODES:-2}
PREFIX=${MPLUG_SLURM_NODE_PREFIX:-node}
CPUS=${MPLUG_SLURM_CPUS_PER_NODE:-8}
MEM=${MPLUG_SLURM_MEM_MB:-4000}
PORT=${MPLUG_SLURM_PORT:-16817}
FIRST_JOB_ID=${MPLUG_SLURM_FIRST_JOB_ID:-1}
READY_TIMEOUT=${MPLUG_SLURM_READY_TIMEOUT:-60}

[[ $DIR == /* ]] || { echo "MPLUG_SLURM_DIR must be an absolute path, got '$DIR'" >&2; exit 2; }
DIR=${DIR%/}
CONF=$DIR/etc/slurm.conf
MUNGE=$DIR/munge
RUN=$DIR/run
LOG=$DIR/log
SPOOL=$DIR/spool
HOSTS_MARKER="# mplug-slurm $DIR"
export SLURM_CONF=$CONF

log() { echo "[local_cluster $(date +%T)] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
trap 'log "ERROR: line $LINENO: \"$BASH_COMMAND\" failed"' ERR

node_names() { local k; for ((k = 1; k <= NODES; k++)); do echo "${PREFIX}${k}"; done; }
node_range() { if ((NODES == 1)); then echo "${PREFIX}1"; else echo "${PREFIX}[1-${NODES}]"; fi; }
require_root() { [[ $(id -u) == 0 ]] || die "run as root (slurmd must start job processes)"; }

# ------------------------------------------------------------------------------------ install
do_install() {
  local pkgs=(munge slurmctld slurmd slurm-client) missing=() p
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then return 0; fi
  command -v apt-get > /dev/null || die "apt-get not found: install ${missing[*]} yourself"
  require_root
  log "installing ${missing[*]}"
  # The packages' postinst scripts would start system-wide daemons: forbid that while installing.
  local own_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; own_policy=1
  fi
  local apt_log; apt_log=$(mktemp)
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
       > "$apt_log" 2>&1; then
    cat "$apt_log" >&2; rm -f "$apt_log"
    ((own_policy)) && rm -f /usr/sbin/policy-rc.d
    die "apt-get install ${missing[*]} failed"
  fi
  rm -f "$apt_log"
  ((own_policy)) && rm -f /usr/sbin/policy-rc.d
  log "installed slurm $(dpkg-query -W -f='${Version}' slurmctld), munge $(dpkg-query -W -f='${Version}' munge)"
}

# ---------------------------------------------------------------------------------- configure
slurm_conf() {
  local k
  cat <<EOF
# Written by slurm/local_cluster.sh: ${NODES} nodes on one machine, everything under ${DIR}
ClusterName=mplug-local
SlurmctldHost=localhost
SlurmctldPort=${PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# socket: our own munged. cred_expire: a requeued job may start again after ~cred_expire s (default 120).
AuthInfo=socket=${MUNGE}/munge.socket,cred_expire=10
StateSaveLocation=${SPOOL}/ctld
SlurmdSpoolDir=${SPOOL}/%n
SlurmctldPidFile=${RUN}/slurmctld.pid
SlurmdPidFile=${RUN}/slurmd-%n.pid
SlurmctldLogFile=${LOG}/slurmctld.log
SlurmdLogFile=${LOG}/slurmd-%n.log
# no cgroups: track job processes through /proc, no task containment
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# trust CPUs/RealMemory below even where the machine has fewer
SlurmdParameters=config_overrides
ReturnToService=2
FirstJobId=${FIRST_JOB_ID}
JobRequeue=1
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=20
InactiveLimit=0
# finished jobs stay visible to "scontrol show job" for 10 minutes (exit codes, restart counts)
MinJobAge=600
KillWait=5
Waittime=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
EOF
  for ((k = 1; k <= NODES; k++)); do
    echo "NodeName=${PREFIX}${k} NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + k)) CPUs=${CPUS} RealMemory=${MEM} State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=$(node_range) Default=YES MaxTime=INFINITE State=UP"
}

add_hosts_line() {  # node names -> 127.0.0.1, in one line tagged with our directory
  local line; line="127.0.0.1 $(node_names | paste -sd' ') ${HOSTS_MARKER}"
  grep -qxF "$line" /etc/hosts && return 0
  remove_hosts_line
  [[ -z $(tail -c 1 /etc/hosts) ]] || echo >> /etc/hosts
  echo "$line" >> /etc/hosts || die "cannot write /etc/hosts (node names must resolve)"
}

remove_hosts_line() {  # in place: /etc/hosts is often a bind mount that cannot be replaced
  local kept
  kept=$(SUFFIX=" $HOSTS_MARKER" awk '{ m = ENVIRON["SUFFIX"] }
    substr($0, length($0) - length(m) + 1) != m' /etc/hosts)
  [[ $kept == "$(cat /etc/hosts)" ]] || printf '%s\n' "$kept" > /etc/hosts
}

configure() {
  install -d -m 755 "$DIR" "$DIR/etc" "$MUNGE" "$RUN" "$LOG" "$SPOOL" "$SPOOL/ctld"
  local n; for n in $(node_names); do install -d -m 755 "$SPOOL/$n"; done
  slurm_conf > "$CONF.new"
  if [[ -f $CONF ]] && ! cmp -s "$CONF" "$CONF.new" && pid_of "$RUN/slurmctld.pid" slurmctld > /dev/null; then
    rm -f "$CONF.new"; die "settings differ from the running cluster in $DIR: run 'stop' first"
  fi
  mv "$CONF.new" "$CONF"
  [[ -s $MUNGE/munge.key ]] || mungekey --create --keyfile="$MUNGE/munge.key"
  chmod 600 "$MUNGE/munge.key"
  add_hosts_line
}

# ---------------------------------------------------------------------------- our processes
pid_of() {  # pid_of PIDFILE COMM: prints the pid if the pid file names a live process called COMM
  local pid
  [[ -s $1 ]] || return 1
  pid=$({ tr -dc '0-9' < "$1"; } 2> /dev/null) || return 1
  [[ -n $pid && $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] || return 1
  [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]] || return 1
  echo "$pid"
}

stop_pidfile() {  # stop_pidfile PIDFILE COMM: TERM, wait up to 10 s, then KILL
  local pid k
  if pid=$(pid_of "$1" "$2"); then
    kill -TERM "$pid" 2> /dev/null || true
    for ((k = 0; k < 100; k++)); do pid_of "$1" "$2" > /dev/null || break; sleep 0.1; done
    if pid_of "$1" "$2" > /dev/null; then log "$2 ($pid) ignored TERM: KILL"; kill -KILL "$pid" 2> /dev/null || true; fi
    log "stopped $2 ($pid)"
  fi
  rm -f "$1"
}

wait_for() {  # wait_for SECONDS COMMAND...: retry every 0.1 s
  local deadline=$((SECONDS + $1)); shift
  until "$@" > /dev/null 2>&1; do ((SECONDS < deadline)) || return 1; sleep 0.1; done
}

munge_ok() { munge -n -S "$MUNGE/munge.socket" | unmunge -S "$MUNGE/munge.socket"; }
ctld_up() { pid_of "$RUN/slurmctld.pid" slurmctld && scontrol ping | grep -q UP; }

# ------------------------------------------------------------------------------------- start
start_munged() {
  pid_of "$RUN/munged.pid" munged > /dev/null && return 0
  # --force: the state dir may lie under a private (0700) temp dir, which munged otherwise
  # refuses because non-root users could not reach the socket; every client here is root.
  munged --force --key-file="$MUNGE/munge.key" --socket="$MUNGE/munge.socket" \
    --pid-file="$RUN/munged.pid" --log-file="$LOG/munged.log" --seed-file="$MUNGE/munged.seed"
  wait_for 5 munge_ok || { tail -5 "$LOG/munged.log" >&2; die "munged did not answer"; }
  log "munged started ($(cat "$RUN/munged.pid"))"
}

start_slurmctld() {
  pid_of "$RUN/slurmctld.pid" slurmctld > /dev/null && return 0
  if scontrol ping 2> /dev/null | grep -q UP; then die "another slurmctld answers on port $PORT"; fi
  slurmctld -f "$CONF"
  wait_for 15 ctld_up || { tail -20 "$LOG/slurmctld.log" >&2; die "slurmctld did not come up"; }
  log "slurmctld started ($(cat "$RUN/slurmctld.pid")) on port $PORT"
}

start_slurmds() {
  local n
  for n in $(node_names); do
    pid_of "$RUN/slurmd-$n.pid" slurmd > /dev/null && continue
    slurmd -f "$CONF" -N "$n"
    wait_for 5 pid_of "$RUN/slurmd-$n.pid" slurmd
    sleep 0.2  # a slurmd that cannot bind its port exits right after writing its pid file
    pid_of "$RUN/slurmd-$n.pid" slurmd > /dev/null || { tail -20 "$LOG/slurmd-$n.log" >&2; die "slurmd $n died"; }
    log "slurmd $n started ($(cat "$RUN/slurmd-$n.pid")) on port $((PORT + ${n#"$PREFIX"}))"
  done
}

wait_ready() {
  local deadline=$((SECONDS + READY_TIMEOUT)) states stale
  while :; do
    states=$(sinfo -h -N -o '%N %t' 2> /dev/null | sort -u || true)
    # nodes left down by an unclean stop come back with 'resume'
    stale=$(awk '$2 ~ /^(down|drain|drng|fail|inval)/ {print $1}' <<< "$states" | paste -sd, -)
    if [[ -n $stale ]]; then scontrol update nodename="$stale" state=resume 2> /dev/null || true; fi
    (($(awk '$2 ~ /^(idle|mix|alloc)$/' <<< "$states" | wc -l) == NODES)) && break
    ((SECONDS < deadline)) || { echo "$states" >&2; die "nodes not idle after ${READY_TIMEOUT}s (logs in $LOG)"; }
    sleep 0.2
  done
  echo ready
}

do_up() {
  require_root
  do_install
  configure
  start_munged
  start_slurmctld
  start_slurmds
  wait_ready
}

# -------------------------------------------------------------------------------------- stop
do_stop() {
  local f k ids
  if ctld_up > /dev/null 2>&1; then
    mapfile -t ids < <(squeue -h -o %A 2> /dev/null)
    if ((${#ids[@]} > 0)); then
      scancel "${ids[@]}" 2> /dev/null || true
      for ((k = 0; k < 100; k++)); do [[ -z $(squeue -h -o %A 2> /dev/null) ]] && break; sleep 0.1; done
    fi
  fi
  for f in "$RUN"/slurmd-*.pid; do [[ -e $f ]] && stop_pidfile "$f" slurmd; done
  stop_pidfile "$RUN/slurmctld.pid" slurmctld
  stop_pidfile "$RUN/munged.pid" munged
  if [[ -w /etc/hosts ]]; then remove_hosts_line; fi
  log "stopped"
}

do_status() {
  local f name
  for f in "$RUN"/*.pid; do
    [[ -e $f ]] || continue
    name=$(basename "$f" .pid)
    if pid_of "$f" "${name%%-*}" > /dev/null; then echo "$name: running ($(cat "$f"))"; else echo "$name: dead"; fi
  done
  sinfo 2>&1 || true
}

do_selftest() {  # 2 nodes, one srun task each; both node names must appear
  local work jid out k
  work=$(mktemp -d "$DIR/selftest.XXXX")
  # shellcheck disable=SC2016  # expanded by the job's shell, not here
  jid=$(sbatch --parsable --nodes="$NODES" --ntasks-per-node=1 --time=2 --chdir="$work" \
        --output="$work/out.txt" --wrap 'srun bash -c "echo task \$SLURM_PROCID on \$SLURMD_NODENAME"')
  for ((k = 0; k < 300; k++)); do [[ -z $(squeue -h -j "$jid" 2> /dev/null) ]] && break; sleep 0.1; done
  out=$(cat "$work/out.txt" 2> /dev/null || true)
  echo "$out"
  for n in $(node_names); do
    grep -q "on $n\$" <<< "$out" || { scontrol show job "$jid" >&2 || true; die "selftest failed: no task on $n ($work)"; }
  done
  rm -rf "$work"
  echo "selftest passed"
}

case "${1:-}" in
  up)       do_up ;;
  stop)     do_stop ;;
  status)   do_status ;;
  selftest) do_selftest ;;
  env)      echo "export SLURM_CONF=$(printf '%q' "$CONF")" ;;
  install)  do_install ;;
  *) echo "usage: $0 up|stop|status|selftest|env|install" >&2; exit 2 ;;
esac
