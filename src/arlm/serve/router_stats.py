"""The prefix router's decisions in this process (serve/cluster.py's `PrefixRouter`), for the
ingress's /metrics. A module of its own, imported by name where it is used: the router's and the
ingress's classes reach their process pickled by value, each with its own copy of cluster.py's
globals, so a global there would be two different objects in one process."""

COUNTS = {"prefix_hits": 0, "fallbacks": 0, "no_prefix": 0}
