#!/usr/bin/env bash
# Start the batching server: ./server.sh {nobatch|static|dynamic}
# Settings come from the environment and .env (see README.md).
set -euo pipefail
cd "$(dirname "$0")"

case "${1:-}" in
  nobatch|static|dynamic) export MODE="$1" ;;
  *) echo "usage: $0 {nobatch|static|dynamic}" >&2; exit 2 ;;
esac

python=python3
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then python=.venv/bin/python; fi
exec "$python" -m gunicorn -c gunicorn.conf.py "app:create_app()"
