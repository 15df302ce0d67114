"""The routers' state in this process (serve/cluster.py's `PrefixRouter`, `PowerOfTwoRouter`), for
the ingress's /metrics. A module of its own, imported by name where it is used: the routers' and
the ingress's classes reach their process pickled by value, each with its own copy of cluster.py's
globals, so a global there would be two different objects in one process."""

COUNTS = {"prefix_hits": 0, "fallbacks": 0, "no_prefix": 0}  # the prefix router's decisions
REPLICAS: list[str] = []  # the engine replicas' ids, as the router last heard of them
