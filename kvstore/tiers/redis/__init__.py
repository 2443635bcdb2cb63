"""The redis tier: one server or a Redis Cluster, its key layout, link, read-ahead and shared session records."""
