#!/usr/bin/env bash
# testhosts.sh — test hosts for the multi-host specs: N network namespaces
# ("hosts") joined by veth pairs to a bridge that lives in a namespace of its
# own (the "switch"), so nothing is added to the machine's own namespace and
# every address (10.77.0.0/24 by default) exists only inside them. Optional
# per-link rate limits (tc tbf); netem is probed and reported, never needed.
# Used by spec/agents_spec.lua and bench/hosts_bench.sh; by hand:
#
#   spec/hosts/testhosts.sh up   NAME N [SUBNET]   make NAME-sw and NAME-h1..hN (host k: SUBNET.k/24)
#   spec/hosts/testhosts.sh down NAME              kill what runs in them, delete them (idempotent)
#   spec/hosts/testhosts.sh exec NAME K CMD...     run CMD on host K
#   spec/hosts/testhosts.sh cut  NAME K            host K's link down (ip link set ... down, both ends)
#   spec/hosts/testhosts.sh restore NAME K         and up again
#   spec/hosts/testhosts.sh slow NAME K RATE       tc tbf at RATE (e.g. 10mbit) both ways on host K's link
#   spec/hosts/testhosts.sh kill NAME K            kill -9 every process on host K (the host lost)
#   spec/hosts/testhosts.sh reach NAME K ADDR      does host K reach ADDR (exit 0) or not (1)?
#   spec/hosts/testhosts.sh probe                  can namespaces be made here? is netem there? (exit 77: no)
#   spec/hosts/testhosts.sh with NAME N CMD...     up, run CMD (env TESTHOSTS=NAME), down whatever happens
#
# Every command is bounded (timeout) and `up` undoes its partial work when a
# step fails. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2.
set -u
PATH=/usr/sbin:/sbin:$PATH
T="timeout 10"

die() { echo "testhosts: $*" >&2; exit 1; }

ns_list() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$1-(sw|h[0-9]+)\$"; }

down() {
  local name=$1 ns pid
  for ns in $(ns_list "$name"); do
    for pid in $($T ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
  done
  for ns in $(ns_list "$name"); do $T ip netns del "$ns" 2>/dev/null; done
  [ -z "$(ns_list "$name")" ] || { echo "testhosts: could not delete every namespace of $name" >&2; return 1; }
}

up() {
  local name=$1 n=$2 net=${3:-10.77.0} k
  [[ $name =~ ^[A-Za-z0-9_]{1,9}$ ]] || die "NAME must be 1-9 letters/digits (interface names are short): $name"
  [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 32 ] || die "N must be 1..32: $n"
  [ -z "$(ns_list "$name")" ] || die "test hosts $name exist already (testhosts.sh down $name)"
  trap 'down "$name"; trap - ERR; exit 1' ERR
  set -E -e
  $T ip netns add "$name-sw"
  $T ip -n "$name-sw" link set lo up
  $T ip -n "$name-sw" link add br0 type bridge
  $T ip -n "$name-sw" link set br0 up
  for k in $(seq 1 "$n"); do
    $T ip netns add "$name-h$k"
    $T ip -n "$name-h$k" link set lo up
    # the pair is made inside the host, one end moved into the switch
    $T ip -n "$name-h$k" link add eth0 type veth peer name "p$k"
    $T ip -n "$name-h$k" link set "p$k" netns "$name-sw"
    $T ip -n "$name-sw" link set "p$k" master br0
    $T ip -n "$name-sw" link set "p$k" up
    $T ip -n "$name-h$k" addr add "$net.$k/24" dev eth0
    $T ip -n "$name-h$k" link set eth0 up
  done
  set +e +E
  trap - ERR
  # wait (bounded) until host 1 reaches the last one: the bridge forwards
  if [ "$n" -gt 1 ]; then
    for _ in $(seq 1 50); do
      reach "$name" 1 "$net.$n" && break
      sleep 0.1
    done
  fi
  for k in $(seq 1 "$n"); do echo "host $k: $name-h$k $net.$k"; done
}

# Does host K reach ADDR? A TCP connect to a closed port: refused (exit 1,
# at once) means the address answered; a timeout means nothing did. (No ping
# needed.)
reach() {
  timeout 1 ip netns exec "$1-h$2" bash -c "exec 3<>/dev/tcp/$3/9" 2>/dev/null
  [ $? -ne 124 ]
}

link() { # NAME K up|down: both ends, as an unplugged cable
  $T ip -n "$1-h$2" link set eth0 "$3" && $T ip -n "$1-sw" link set "p$2" "$3"
}

slow() { # NAME K RATE: tbf both ways (host egress, switch port egress = host ingress)
  local burst=32kbit
  $T tc -n "$1-h$2" qdisc replace dev eth0 root tbf rate "$3" burst $burst latency 400ms &&
    $T tc -n "$1-sw" qdisc replace dev "p$2" root tbf rate "$3" burst $burst latency 400ms &&
    echo "testhosts: host $2's link limited to $3 with tbf"
}

probe() {
  [ "$(id -u)" = 0 ] || { echo "testhosts: not root: cannot make network namespaces"; exit 77; }
  command -v ip >/dev/null || { echo "testhosts: iproute2 missing (apt-get install iproute2)"; exit 77; }
  local p=thp$$
  if ! $T ip netns add "$p-sw" 2>/dev/null; then echo "testhosts: cannot make network namespaces here"; exit 77; fi
  local netem=no
  $T ip -n "$p-sw" link add d0 type veth peer name d1 2>/dev/null && $T ip -n "$p-sw" link set d0 up &&
    $T tc -n "$p-sw" qdisc add dev d0 root netem delay 1ms 2>/dev/null && netem=yes
  local tbf=no
  $T tc -n "$p-sw" qdisc replace dev d0 root tbf rate 10mbit burst 32kbit latency 400ms 2>/dev/null && tbf=yes
  $T ip netns del "$p-sw"
  echo "testhosts: namespaces yes, tbf $tbf, netem $netem"
}

cmd=${1:-}
shift || true
case "$cmd" in
  up) [ $# -ge 2 ] || die "usage: up NAME N [SUBNET]"; up "$@" ;;
  down) [ $# -eq 1 ] || die "usage: down NAME"; down "$1" ;;
  exec) [ $# -ge 3 ] || die "usage: exec NAME K CMD..."; n=$1 k=$2; shift 2; exec ip netns exec "$n-h$k" "$@" ;;
  cut) link "$1" "$2" down ;;
  restore) link "$1" "$2" up ;;
  slow) slow "$1" "$2" "$3" ;;
  kill) for pid in $($T ip netns pids "$1-h$2"); do kill -9 "$pid" 2>/dev/null; done ;;
  probe) probe ;;
  reach) reach "$1" "$2" "$3" ;;
  with)
    [ $# -ge 3 ] || die "usage: with NAME N CMD..."
    name=$1 n=$2; shift 2
    trap 'down "$name"' EXIT
    trap 'exit 130' INT TERM
    up "$name" "$n" # not `up ... || exit`: in a || list bash ignores set -e and the ERR trap inside up
    TESTHOSTS=$name "$@"
    ;;
  *) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; [ -z "$cmd" ] || [ "$cmd" = -h ] || [ "$cmd" = --help ] || exit 2 ;;
esac
