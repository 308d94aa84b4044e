"""The `kvcache serve` daemon: the cache's HTTP API over one BlockStore (docs/api.md).

    daemon.py        run the daemon: settings, process hardening, store, serve loop (cli/serve.py calls it)
    app.py           build_app: the middlewares, the app's state and every route
    request_state.py what each request carries: app keys, its Principal, the token check
    request_body.py  hex keys into the tenant's space, JSON and plain bodies within their limits
    errors.py        what a failed request is answered, and what is logged about it
    config.py        ServerConfig, the [server] section and tokens from the environment

  the cache API, one module per concern:
    blocks.py        put, get, head, batch_put, batch_get, lookup, exists, pin, unpin, delete
    namespaces.py    POST /v1/namespaces
    admin.py         /healthz, /v1/gc, /v1/stats, /metrics
    reconfigure.py   POST /v1/admin/reconfigure and SIGHUP: hot settings swapped in
    shm_routes.py    GET /v1/shm and the shared-memory control socket's lifetime
  what they share:
    tenancy.py       namespace ids and registrations in a tenant's key space
    quota.py         tenant quotas and pending upload bytes under concurrent puts
    put_batch.py     one KVB1 upload turned into store calls, a chunk at a time
    batch_get.py     block reads streamed with bounded memory
    metrics.py       Prometheus metrics
    shm_leases.py    the shared-memory lease table; shm_control.py its control socket
    front/           the connections: listening sockets, request heads, native bulk uploads
                     (the front is handed its upload path as callbacks and imports no handler)
  beside the cache API:
    model_api/       `kvcache serve --model`: OpenAI- and Anthropic-compatible routes over the
                     engine (daemon.py adds them to the app; its own app with --cache URL)

Imports go one way: handlers -> request_state/request_body -> errors, config, quota, metrics;
app.py and daemon.py on top. No module here imports another in a cycle. model_api/ imports
request_state and errors, never the reverse: the token check reaches its error shapes through
request_state.REFUSAL, a callable the model routes set.
"""
