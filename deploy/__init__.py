"""Running replicas behind HAProxy: its configuration, and the helpers cluster.sh runs."""
