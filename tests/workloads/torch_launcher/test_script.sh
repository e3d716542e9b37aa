#!/bin/bash
# From pytorch/pytorch, test/distributed/launcher/bin/test_script.sh (torch's own launcher tests),
# unchanged below this comment; used by tests/e2e/test_torchrun_parity.py. BSD-style licence:
# see https://github.com/pytorch/pytorch/blob/main/LICENSE.

# Copyright (c) Facebook, Inc. and its affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

FILE="$1/$RANK"
echo "creating $FILE"
touch "$FILE"
