"""The operator's commands: the `kvmem` console script (serve, build, provision), the offline block build
and its stamp, and a loopback cluster (PostgreSQL, Redis, replicas behind HAProxy)."""
