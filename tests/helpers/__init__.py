"""Helpers the tests share: daemons, stores, page layouts, clusters, and driver scripts."""
