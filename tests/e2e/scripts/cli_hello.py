"""Says hello on stdout and stderr with its rank, then exits 0."""

import os
import sys

rank = os.environ["RANK"]
print(f"hello from rank {rank}", flush=True)
print(f"note from rank {rank}", file=sys.stderr, flush=True)
