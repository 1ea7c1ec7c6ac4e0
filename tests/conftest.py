import logging
import os
import sys
from collections.abc import Iterator

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _restore_package_logger() -> Iterator[None]:
    # cli.main() configures the "microbatch" logger (its own handler, no propagation); put it back
    # so later tests' caplog, which listens on the root logger, still sees the package's records.
    package_logger = logging.getLogger("microbatch")
    handlers, level, propagate = list(package_logger.handlers), package_logger.level, package_logger.propagate
    yield
    package_logger.handlers[:] = handlers
    package_logger.setLevel(level)
    package_logger.propagate = propagate


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    # The command-line tests' models are tiny: one thread is faster than two, and far faster on a
    # busy machine. (The package logger that cli.main configures is restored by the fixture above.)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps its state in process-wide singletons (an HF Trainer with gradient
    accumulation leaves GradientState accumulating, and a later Accelerator's optimizer then skips
    steps): every test starts from none."""
    yield
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        GradientState._reset_state()
        AcceleratorState._reset_state(reset_partial_state=True)
