"""The daemon over gRPC and the local socket: save and load beside their ceilings, revisions, a profile."""
