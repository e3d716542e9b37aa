"""A worker whose return file is written by someone other than gelastic's bootstrap.

`forge_return_file` does what any other process of the same user on the node can do: it writes
the worker's `return.pkl` itself (a pickle that creates `marker` when loaded, behind a tag made
with a key that is not the job's), then ends the worker with exit code 0 before the bootstrap
writes the real one.
"""

from __future__ import annotations

import os
import pickle
import secrets

_MAGIC = b"GELASTIC-RV/1\x00"


class _Mkdir:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.path,))


def forge_return_file(marker: str) -> None:
    return_file = os.path.join(os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"]), "return.pkl")
    with open(return_file, "wb") as f:
        f.write(_MAGIC + secrets.token_bytes(32) + pickle.dumps(_Mkdir(marker)))
    os._exit(0)
