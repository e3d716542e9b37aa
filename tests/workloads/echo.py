"""Prints how it was started; run as a script, with -m, or from -c, directly or under gelastic."""

import json
import os
import sys


def describe() -> str:
    return json.dumps(
        {
            "argv": sys.argv,
            "path0": sys.path[0],
            "name": __name__,
            "cwd": os.getcwd(),
            "main_file": getattr(sys.modules["__main__"], "__file__", None),
        }
    )


if __name__ == "__main__":
    print(describe())
