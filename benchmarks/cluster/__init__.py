"""Scale-out: daemons sharing sessions through Redis and Redis Cluster."""
