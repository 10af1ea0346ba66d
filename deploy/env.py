"""The settings cluster.sh needs, read as every replica reads its own (environment, then .env).

Printed as shell assignments for cluster.sh to eval, so that one parser, config.Settings, and
one set of defaults serve the balancer and the replicas alike.
"""

import os
import shlex
import sys

from config import Settings

MARGIN_S = 60  # the balancer waits this much longer than a replica, which answers its own timeout


def main() -> None:
    try:
        settings = Settings.from_env()
    except ValueError as err:
        sys.exit(f"error: {err}")
    values = {
        "host": settings.host,
        "port": settings.port,
        "block_size": settings.block_size,
        "timeout": f"{int(settings.request_timeout_s) + MARGIN_S}s",
        "device": settings.device,
        "engine": settings.engine,
    }
    # cluster.sh's own variables, and the GPUs to share out; load_dotenv has put .env's there too
    for name in ("REPLICAS_AT", "RUN_DIR", "HAPROXY", "BALANCE", "CUDA_VISIBLE_DEVICES"):
        values[name.lower()] = os.environ.get(name, "")
    print("\n".join(f"{name}={shlex.quote(str(value))}" for name, value in values.items()))


if __name__ == "__main__":
    main()
