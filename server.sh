#!/usr/bin/env bash
# Start the batching server: ./server.sh {nobatch|static|dynamic}
# Settings come from the environment and .env (see docs/settings.md). Exposed (HOST not loopback) or
# with TLS_CERT, it serves through a front door: HAProxy on HOST:PORT (deploy/haproxy.cfg, with
# its timeouts and per-client limits) before gunicorn on 127.0.0.1:PORT+1, run by cluster.sh as
# a cluster of one. FRONT=off, or no haproxy installed: gunicorn listens on HOST:PORT itself.
set -euo pipefail
cd "$(dirname "$0")"

case "${1:-}" in
  nobatch|static|dynamic) export MODE="$1" ;;
  *) echo "usage: $0 {nobatch|static|dynamic}" >&2; exit 2 ;;
esac

python=python3
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then python=.venv/bin/python; fi

settings=$("$python" -m deploy.env)  # a bad setting stops here, with its one line
front='' haproxy='' tls_cert=''
eval "$settings"
if [ "$front" = on ]; then
  if [ -x "$haproxy" ]; then
    SERVER_FRONT=1 exec ./cluster.sh 1 "$MODE"
  fi
  [ -z "$tls_cert" ] || { echo "server: error: TLS_CERT needs HAProxy to terminate TLS: apt-get install haproxy" >&2; exit 1; }
  echo "server: WARNING: haproxy is not installed: serving without a front door (see the log's warning)" >&2
fi
exec "$python" -m gunicorn -c gunicorn.conf.py "app:create_app()"
