"""The coordinator: rendezvous, ranks, restarts, the exit barrier and results, over gRPC."""
