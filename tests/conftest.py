"""The session's background jobs (tests/background.py): queued as it starts, for the tests selected.

Torch computes on one thread here, as in the kept gloo processes (tests/dist_harness.py) and the jobs' commands: on
2 cores shared with them, an operation split over two OpenMP threads waits for whichever is not running (the gpu_fa4
script's test took 26 s instead of 1.5 s beside one busy process).
"""

import background
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def background_jobs(request, tmp_path_factory):
    background.start(request.session.items, tmp_path_factory.mktemp)
    yield
    background.stop()
