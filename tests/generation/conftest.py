import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module (a module takes it with ``pytestmark = pytest.mark.usefixtures
    ("one_thread")``): the tiny model runs fastest on one thread (and worker processes use one), two
    threads on a busy 2-core machine mostly wait for each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
