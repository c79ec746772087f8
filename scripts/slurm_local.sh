#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for tests and for trying the launch:
#   scripts/slurm_local.sh up [N]   install what is missing (Debian: slurm-wlm, munge), write
#                                   /etc/slurm/{slurm,gres}.conf for nodes node1..nodeN (default 3),
#                                   start munged, slurmctld and one `slurmd -N nodeK` per node, wait
#                                   until sinfo shows every node idle
#   scripts/slurm_local.sh down     stop every daemon `up` started (by pid file), remove its state
#   scripts/slurm_local.sh status   sinfo, or exit 1 when the cluster is not up
# Needs root (apt-get, daemons, /etc). Debian builds SLURM with multiple-slurmd support, so each
# `slurmd -N nodeK` is a separate node to SLURM; all of them run on this host:
#   * every node declares CPUs=1 RealMemory=7000 Gres=gpu:8 (SlurmdParameters=config_overrides:
#     slurmd does not compare them with the machine); the 8 GPUs are character devices made with
#     mknod (/dev/moe_rl_gpu0..7) so --gpus-per-node is satisfiable; nothing opens them;
#   * ProctrackType=proctrack/linuxproc, TaskPlugin=task/none: no cgroups (a container has none);
#   * name resolution: the node names are added to /etc/hosts as 127.0.0.1 (one marked line,
#     removed by `down`), exactly what DNS does for node names on a real cluster, so the launch plan
#     (http://node1:30000, rendezvous at node2) needs no local special case.
# Environment: SLURM_LOCAL_NODES (default 3), SLURM_LOCAL_PORT (slurmctld port, default 6817; the
# slurmds use the next N ports), SLURM_LOCAL_KILLWAIT (default 30: SLURM's own default),
# SLURM_LOCAL_CRED_EXPIRE (default 30: how long a requeued job waits before it starts again; SLURM: 120).
set -euo pipefail

ACTION=${1:-}
NODES=${2:-${SLURM_LOCAL_NODES:-3}}
CTLD_PORT=${SLURM_LOCAL_PORT:-6817}
KILLWAIT=${SLURM_LOCAL_KILLWAIT:-30}
CRED_EXPIRE=${SLURM_LOCAL_CRED_EXPIRE:-30}
CONF_DIR=/etc/slurm
STATE=/var/spool/moe_rl_slurm
RUN=/run/moe_rl_slurm
LOGS=/var/log/moe_rl_slurm
HOSTS_MARK="# moe_rl slurm_local.sh"

die() { echo "slurm_local: $*" >&2; exit 1; }
say() { echo "slurm_local: $*"; }

need_root() { [[ $(id -u) == 0 ]] || die "must run as root (installs packages, starts daemons, writes /etc/slurm)"; }

install_packages() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurm-wlm)
  command -v munged >/dev/null || missing+=(munge)
  command -v curl >/dev/null || missing+=(curl)
  ((${#missing[@]})) || return 0
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get (Debian/Ubuntu only); install SLURM and munge yourself"
  say "installing ${missing[*]} (apt-get)"
  # policy-rc.d: Debian would start the packaged services; this script starts its own daemons.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; } \
    || die "apt-get install ${missing[*]} failed"
}

write_conf() {
  local host last
  host=$(hostname -s)
  last=$((CTLD_PORT + NODES))
  mkdir -p "$CONF_DIR" "$STATE/ctld" "$RUN" "$LOGS"
  for i in $(seq 0 7); do
    [[ -c /dev/moe_rl_gpu$i ]] || mknod /dev/moe_rl_gpu$i c 195 "$i" || die "mknod /dev/moe_rl_gpu$i failed"
  done
  cat >"$CONF_DIR/slurm.conf" <<EOF
# written by moe_rl scripts/slurm_local.sh: $NODES nodes on host $host (one slurmd -N nodeK each)
ClusterName=moe_rl_local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits cred_expire seconds before it may start again (SLURM's default: 120)
AuthInfo=cred_expire=$CRED_EXPIRE
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SchedulerType=sched/backfill
# the main scheduling pass every 5 s (default 60): a requeued job starts once cred_expire has passed, not up to
# a minute later (nothing else of SLURM's is timed by it; 3 nodes make each pass trivial)
SchedulerParameters=sched_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d-%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=$KILLWAIT
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
MessageTimeout=30
NodeName=node[1-$NODES] NodeHostname=$host NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 1))-$last CPUs=1 RealMemory=7000 Gres=gpu:8 State=UNKNOWN
PartitionName=local Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP
EOF
  echo "NodeName=node[1-$NODES] Name=gpu File=/dev/moe_rl_gpu[0-7]" >"$CONF_DIR/gres.conf"
  local names=""
  for i in $(seq 1 "$NODES"); do names+=" node$i"; done
  sed -i "/$HOSTS_MARK\$/d" /etc/hosts 2>/dev/null || true
  echo "127.0.0.1$names $HOSTS_MARK" >>/etc/hosts
}

start_munge() {
  if [[ -f $RUN/munged.pid ]] && kill -0 "$(cat "$RUN/munged.pid")" 2>/dev/null; then return 0; fi
  [[ -s /etc/munge/munge.key ]] || { mungekey --create 2>/dev/null || /usr/sbin/mungekey --create; }
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/lib/munge /var/log/munge && chown munge:munge /run/munge /var/lib/munge /var/log/munge
  runuser -u munge -- munged --force || die "munged did not start (see /var/log/munge/munged.log)"
  for _ in $(seq 50); do [[ -s /run/munge/munged.pid ]] && munge -n </dev/null >/dev/null 2>&1 && break; sleep 0.1; done
  cp /run/munge/munged.pid "$RUN/munged.pid"
  munge -n </dev/null | unmunge >/dev/null || die "munge does not work (see /var/log/munge/munged.log)"
}

wait_idle() {
  local deadline=$((SECONDS + 60)) idle
  while :; do
    idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle"' | wc -l)
    ((idle == NODES)) && { say "up: $NODES nodes idle"; sinfo; return 0; }
    ((SECONDS < deadline)) || { sinfo -N -l >&2 || true; tail -20 "$LOGS"/slurm*.log >&2 || true; die "nodes not idle within 60 s"; }
    sleep 0.5
  done
}

up() {
  need_root
  install_packages
  if status >/dev/null 2>&1; then say "already up"; sinfo; return 0; fi
  write_conf
  start_munge
  slurmctld -i 2>>"$LOGS/start.err" || die "slurmctld did not start (see $LOGS/slurmctld.log)"
  for i in $(seq 1 "$NODES"); do
    mkdir -p "$STATE/d-node$i"
    slurmd -N "node$i" 2>>"$LOGS/start.err" || die "slurmd -N node$i did not start (see $LOGS/slurmd-node$i.log)"
  done
  wait_idle
}

stop_pidfile() {  # stop_pidfile FILE: SIGTERM the daemon, SIGKILL it after 10 s
  local file=$1 pid
  [[ -f $file ]] || return 0
  pid=$(cat "$file" 2>/dev/null || true)
  if [[ -n $pid ]] && kill "$pid" 2>/dev/null; then
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}

down() {
  need_root
  if [[ -f $RUN/slurmctld.pid ]] && command -v scancel >/dev/null; then
    # cancel what still runs and let slurmd end it (SIGTERM, SIGKILL after KillWait): no job outlives `down`
    scancel --user=root --quiet 2>/dev/null || true
    local deadline=$((SECONDS + KILLWAIT + 30))
    while [[ -n $(squeue -h -t running,completing -o %i 2>/dev/null) ]] && ((SECONDS < deadline)); do sleep 1; done
  fi
  for f in "$RUN"/slurmd-*.pid; do stop_pidfile "$f"; done
  stop_pidfile "$RUN/slurmctld.pid"
  stop_pidfile "$RUN/munged.pid"
  sed -i "/$HOSTS_MARK\$/d" /etc/hosts 2>/dev/null || true
  rm -rf "$STATE" "$RUN"
  say "down"
}

status() {
  [[ -f $RUN/slurmctld.pid ]] && kill -0 "$(cat "$RUN/slurmctld.pid")" 2>/dev/null && sinfo
}

case "$ACTION" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up [N] | down | status" >&2; exit 2 ;;
esac
