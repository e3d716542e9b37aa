"""The coordinator: rendezvous, ranks, restarts, the exit barrier and results, over gRPC."""

import os as _os

# The agent forks workers; grpc's fork handlers would run in those children (between fork and
# exec) and abort them. gelastic never uses grpc across fork, so the handlers stay off.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
