"""Test helper: a torch-style script that reads torchrun's restart variables. Worker 1 exits 3 on the
first attempt (TORCHELASTIC_RESTART_COUNT 0); every worker prints what it read on the next."""

import os
import sys

count = os.environ["TORCHELASTIC_RESTART_COUNT"]
assert os.environ["TORCHELASTIC_RESTART_COUNT"] == os.environ["PSLAUNCH_RESTART_COUNT"], dict(os.environ)
assert os.environ["TORCHELASTIC_RUN_ID"] == os.environ["PSLAUNCH_JOB_ID"]
if count == "0" and os.environ["RANK"] == "1":
    sys.exit(3)
print(f"rank {os.environ['RANK']} attempt {count} of {os.environ['TORCHELASTIC_MAX_RESTARTS']} restarts", flush=True)
