"""The gRPC daemon: config, auth, the servicer, and serve()."""
