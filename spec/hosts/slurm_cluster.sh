#!/usr/bin/env bash
# slurm_cluster.sh — a real Slurm cluster on test hosts (testhosts.sh): a
# munged of its own (socket in DIR), slurmctld on host 1, one slurmd per
# host 2..N (each in its network namespace, with cgroup v1 controllers
# mounted in a private mount and cgroup namespace: Debian's slurmd 22.05
# will not start without a cgroup plugin, and refuses this machine's hybrid
# v1/v2 layout with cgroup/v2). Everything lives under DIR; SLURM_CONF=DIR/
# slurm.conf points the clients (sbatch, srun, scontrol, run on host 1) at it.
# Used by spec/slurm_spec.lua; needs slurm-wlm and munge (Debian packages).
#
#   spec/hosts/slurm_cluster.sh up   NAME N DIR    testhosts up NAME N, then the daemons (waits until N-1 nodes are idle)
#   spec/hosts/slurm_cluster.sh down NAME DIR      stops the daemons, testhosts down NAME
#   spec/hosts/slurm_cluster.sh probe              exit 77 with a reason unless it can run here
set -u
PATH=/usr/sbin:/sbin:$PATH
TH=$(dirname "$0")/testhosts.sh

probe() {
  for b in slurmctld slurmd sbatch munged; do
    command -v $b >/dev/null || { echo "slurm_cluster: no $b (apt-get install slurm-wlm munge)"; exit 77; }
  done
  [ -r /etc/munge/munge.key ] || { echo "slurm_cluster: no /etc/munge/munge.key"; exit 77; }
  out=$($TH probe) || { echo "$out"; exit 77; }
}

down() {
  local name=$1 dir=$2 f
  for f in "$dir"/*.pid; do [ -e "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null; done
  $TH down "$name"
}

up() {
  local name=$1 n=$2 dir=$3 k nodes=""
  mkdir -p "$dir"/{state,spool,log}
  $TH up "$name" "$n" > /dev/null || return 1
  munged --force --socket="$dir/munge.sock" --key-file=/etc/munge/munge.key --pid-file="$dir/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munge.seed" || { down "$name" "$dir"; return 1; }
  for k in $(seq 2 "$n"); do nodes+="${nodes:+,}h$k"; mkdir -p "$dir/spool/h$k"; done
  {
    echo "ClusterName=transomtest"
    echo "SlurmctldHost=$(hostname -s)(10.77.0.1)"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    # cred_expire: how long a revoked job credential is remembered, and so
    # how long a requeued job waits before it starts again (default 120 s;
    # started sooner, its batch step is refused: "Job credential revoked")
    echo "AuthInfo=socket=$dir/munge.sock,cred_expire=5"
    echo "CredType=cred/munge"
    echo "StateSaveLocation=$dir/state"
    echo "SlurmdSpoolDir=$dir/spool/%n"
    echo "SlurmctldPidFile=$dir/slurmctld.pid"
    echo "SlurmdPidFile=$dir/slurmd-%n.pid"
    echo "SlurmctldLogFile=$dir/log/slurmctld.log"
    echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "SlurmdParameters=config_overrides"
    echo "MailProg=/bin/true"
    echo "ReturnToService=2"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "KillWait=10"
    for k in $(seq 2 "$n"); do echo "NodeName=h$k NodeAddr=10.77.0.$k CPUs=2 State=UNKNOWN"; done
    echo "PartitionName=test Nodes=$nodes Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
  } > "$dir/slurm.conf"
  printf 'CgroupPlugin=cgroup/v1\nIgnoreSystemd=yes\n' > "$dir/cgroup.conf"
  export SLURM_CONF=$dir/slurm.conf
  $TH exec "$name" 1 slurmctld -i > "$dir/log/slurmctld.out" 2>&1
  for k in $(seq 2 "$n"); do
    $TH exec "$name" "$k" unshare -m -C sh -c 'mount -t tmpfs none /sys/fs/cgroup &&
      for c in freezer cpuset memory devices cpuacct; do
        mkdir -p /sys/fs/cgroup/$c && mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c || exit 1
      done && exec slurmd -N h'"$k" > "$dir/log/slurmd-h$k.out" 2>&1
  done
  for _ in $(seq 1 100); do
    [ "$($TH exec "$name" 1 sinfo -h -t idle -o %D 2>/dev/null)" = "$((n - 1))" ] && return 0
    sleep 0.2
  done
  echo "slurm_cluster: the nodes did not come up:" >&2
  $TH exec "$name" 1 sinfo >&2
  down "$name" "$dir"
  return 1
}

cmd=${1:-}
shift || true
case "$cmd" in
  up) [ $# -eq 3 ] || { echo "usage: up NAME N DIR" >&2; exit 2; }; probe > /dev/null; up "$@" ;;
  down) [ $# -eq 2 ] || { echo "usage: down NAME DIR" >&2; exit 2; }; down "$@" ;;
  probe) probe; echo "slurm_cluster: slurm-wlm, munge and namespaces here" ;;
  *) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
