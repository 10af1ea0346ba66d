#!/usr/bin/env bash
# Start N replicas of ./server.sh MODE behind HAProxy, in the foreground:
#   ./cluster.sh N {nobatch|static|dynamic}
# Replica i listens on 127.0.0.1:PORT+i (with GPU i, where there are GPUs), HAProxy on HOST:PORT.
# ./server.sh runs it as its front door when exposed (a cluster of one: SERVER_FRONT=1).
# Or put HAProxy in front of replicas already running, on this machine or others:
#   REPLICAS_AT=host:port,host:port ./cluster.sh       (or REPLICAS_AT=FILE, one host:port a line)
# Settings come from the environment and .env, as for ./server.sh (see docs/settings.md). RUN_DIR
# (default: a new temporary directory) receives the filled-in HAProxy configuration, the
# replicas' logs and the sockets. BALANCE=roundrobin (default: prefix) sends requests in turn
# instead of by prompt prefix. Ctrl-C or SIGTERM stops everything it started.
set -euo pipefail
cd "$(dirname "$0")"

usage() { echo "usage: $0 N {nobatch|static|dynamic}    or    REPLICAS_AT=host:port,... $0" >&2; exit 2; }
die() { echo "cluster: error: $*" >&2; exit 1; }

replicas=0
if [ $# -eq 2 ]; then
  [[ "$1" =~ ^[1-9][0-9]*$ ]] || usage
  case "$2" in nobatch|static|dynamic) export MODE="$2" ;; *) usage ;; esac
  replicas=$1
elif [ $# -ne 0 ]; then
  usage
fi

python=python3
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then python=.venv/bin/python; fi
# The settings as every replica will read them (environment, then .env), and cluster.sh's own.
host='' port='' block_size='' timeout='' device='' engine='' replica='' replicas_at='' run_dir='' haproxy='' balance=''
cuda_visible_devices='' server_front='' tls_cert='' read_timeout='' queue_timeout='' bufsize='' replica_maxconn=''
limits='' limit_connections='' limit_requests='' limit_period='' limit_by=''
settings=$("$python" -m deploy.env --warn)
eval "$settings"

if [ "$replicas" -eq 0 ] && [ -z "$replicas_at" ]; then usage; fi
if [ "$replicas" -gt 0 ] && [ -n "$replicas_at" ]; then
  die "REPLICAS_AT names the replicas to front: give it without N and MODE, or unset it"
fi
balance=${balance:-prefix}
case "$balance" in prefix|roundrobin) ;; *) die "BALANCE must be prefix or roundrobin, not '$balance'" ;; esac
[ -x "$haproxy" ] || die "HAProxy not found${haproxy:+ at $haproxy}: apt-get install haproxy (or set HAPROXY to its path)"
run_dir=${run_dir:-$(mktemp -d "${TMPDIR:-/tmp}/gpt2-cluster.XXXXXX")}
mkdir -p "$run_dir"

addresses=() replica_pids=() stats_pid='' haproxy_pid=''

stop() {
  trap '' INT TERM  # one orderly stop, however many Ctrl-Cs
  # HAProxy first stops taking connections but relays the requests it has to their end,
  # while the replicas finish theirs (their graceful shutdown); then the rest goes.
  if [ -n "$haproxy_pid" ]; then kill -USR1 "$haproxy_pid" 2>/dev/null || true; fi
  for pid in "${replica_pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for pid in "${replica_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  for pid in $stats_pid $haproxy_pid; do
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

healthy() { "$python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "http://$1/health" 2>/dev/null; }

if [ -n "$replicas_at" ]; then
  if [ -f "$replicas_at" ]; then replicas_at=$(sed 's/#.*//' "$replicas_at"); fi
  for address in ${replicas_at//,/ }; do
    [[ "$address" =~ ^[^:/]+:[0-9]+$ ]] || die "REPLICAS_AT: '$address' is not host:port"
    addresses+=("$address")
    healthy "$address" || echo "cluster: warning: replica $address is not healthy (yet); HAProxy will check it" >&2
  done
  [ ${#addresses[@]} -gt 0 ] || die "REPLICAS_AT names no replica"
else
  gpus=()
  if [ "$engine" != sim ] && [ "$device" != cpu ]; then
    if [ -n "$cuda_visible_devices" ]; then
      IFS=, read -ra gpus <<<"$cuda_visible_devices"
    elif command -v nvidia-smi >/dev/null; then
      mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader)
    fi
    if [ ${#gpus[@]} -gt 0 ] && [ "$replicas" -gt ${#gpus[@]} ]; then
      die "$replicas replicas but ${#gpus[@]} GPUs: one replica per GPU (or DEVICE=cpu)"
    fi
  fi
  for i in $(seq 1 "$replicas"); do
    address=127.0.0.1:$((port + i))
    gpu=()
    if [ ${#gpus[@]} -gt 0 ]; then gpu=("CUDA_VISIBLE_DEVICES=${gpus[i - 1]}"); fi
    # A session of its own: a terminal's Ctrl-C reaches only this script, which stops the
    # replica's whole process group (gunicorn and its worker) with SIGTERM, in order.
    # server.sh's front door: the server keeps its own name, and its log goes where it always went.
    name=$address
    if [ -n "$server_front" ]; then name=$replica; exec 3>&1; else exec 3>"$run_dir/replica-$((port + i)).log"; fi
    # The balancer is the replica's front door: it serves plain HTTP on loopback (FRONT=off and no
    # TLS_CERT, or its server.sh would start a front door of its own).
    setsid env "${gpu[@]}" HOST=127.0.0.1 PORT=$((port + i)) REPLICA_NAME="$name" FRONT=off TLS_CERT= \
      ./server.sh "$MODE" >&3 2>&3 &
    exec 3>&-
    replica_pids+=("$!")
    addresses+=("$address")
  done
  deadline=$((SECONDS + 600))  # a first start may download the model
  for i in "${!addresses[@]}"; do
    log=$run_dir/replica-$((port + i + 1)).log
    if [ -n "$server_front" ]; then log="above"; fi
    until healthy "${addresses[i]}"; do
      if ! kill -0 "${replica_pids[i]}" 2>/dev/null; then
        if [ -f "$log" ]; then tail -n 20 "$log" >&2; fi
        die "replica ${addresses[i]} exited before it was healthy (log: $log)"
      fi
      [ $SECONDS -lt $deadline ] || die "replica ${addresses[i]} not healthy within 600 s (log: $log)"
      sleep 0.5
    done
  done
fi

# The balancer's /stats: every replica's, and the sums (deploy/stats.py). Not for server.sh's
# front door, whose one server's /stats and /dashboard are the server's.
aggregate=on
if [ -n "$server_front" ]; then aggregate=off; fi
if [ $aggregate = on ]; then
  rm -f "$run_dir/stats.sock"
  setsid "$python" -m deploy.stats "$run_dir/stats.sock" "${addresses[@]}" &
  stats_pid=$!
  until [ -S "$run_dir/stats.sock" ]; do
    kill -0 "$stats_pid" 2>/dev/null || die "the /stats aggregator (deploy/stats.py) exited"
    sleep 0.1
  done
fi

config=$run_dir/haproxy.cfg
{
  cat deploy/haproxy.cfg
  for address in "${addresses[@]}"; do
    # The id places the server on the hash ring; from its address, so that adding or removing
    # a replica leaves the others where they were.
    crc=$(printf '%s' "$address" | cksum | cut -d' ' -f1)
    echo "    server $address $address id $((crc % 2147483646 + 1))"
  done
} >"$config"
export CLUSTER_BIND="$host:$port" CLUSTER_BLOCK_SIZE="$block_size" CLUSTER_TIMEOUT="$timeout" CLUSTER_RUN_DIR="$run_dir" \
  CLUSTER_BALANCE="$balance" CLUSTER_AGGREGATE="$aggregate" CLUSTER_TLS_CERT="$tls_cert" CLUSTER_READ_TIMEOUT="$read_timeout" \
  CLUSTER_QUEUE_TIMEOUT="$queue_timeout" CLUSTER_BUFSIZE="$bufsize" CLUSTER_REPLICA_MAXCONN="$replica_maxconn" \
  CLUSTER_LIMITS="$limits" CLUSTER_LIMIT_CONNECTIONS="$limit_connections" CLUSTER_LIMIT_REQUESTS="$limit_requests" \
  CLUSTER_LIMIT_PERIOD="$limit_period" CLUSTER_LIMIT_BY="$limit_by"
"$haproxy" -c -q -f "$config" || die "HAProxy refused its configuration, $config"
setsid "$haproxy" -db -f "$config" &
haproxy_pid=$!

probe=$host
if [ "$host" = 0.0.0.0 ]; then probe=127.0.0.1; fi
until (exec 3<>"/dev/tcp/$probe/$port") 2>/dev/null; do  # listening; the replicas may not be up yet
  kill -0 "$haproxy_pid" 2>/dev/null || die "HAProxy exited (is $host:$port free?)"
  sleep 0.2
done
scheme=http
if [ -n "$tls_cert" ]; then scheme=https; fi
echo "cluster: $scheme://$host:$port -> ${addresses[*]} ($balance; per-client limits $limits); config and logs in $run_dir"

# Serve until HAProxy ends or a signal comes; a replica that dies is HAProxy's to route around.
while true; do
  gone=''
  wait -n -p gone || true
  if [ "$gone" = "$haproxy_pid" ]; then die "HAProxy exited"; fi
  if [ "$gone" = "$stats_pid" ]; then echo "cluster: warning: the /stats aggregator exited" >&2; fi
  for i in "${!replica_pids[@]}"; do
    if [ "$gone" = "${replica_pids[i]}" ]; then
      echo "cluster: warning: replica ${addresses[i]} exited; HAProxy routes around it" >&2
    fi
  done
done
