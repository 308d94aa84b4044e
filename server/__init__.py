"""The `kvcache serve` daemon: the cache's HTTP API over one BlockStore (docs/api.md).

    app.py           the aiohttp application: middlewares, handlers, routes (build_app)
    config.py        ServerConfig, the [server] section and tokens from the environment
    errors.py        what a failed request is answered, and what is logged about it
    reconfigure.py   POST /v1/admin/reconfigure and SIGHUP: hot settings swapped in
    tenancy.py       namespace ids and registrations in a tenant's key space
    quota.py         tenant quotas and pending upload bytes under concurrent puts
    put_batch.py     one KVB1 upload turned into store calls, a chunk at a time
    batch_get.py     block reads streamed with bounded memory
    metrics.py       Prometheus metrics (/metrics)
    shm_leases.py    the same-host shared-memory read path: GET /v1/shm and its lease table
    shm_control.py   the shared-memory control socket (HELLO, LEASE, RELEASE, TOUCH)
    front/           the connections: listening sockets, request heads, native bulk uploads
"""
